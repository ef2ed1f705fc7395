"""``python -m pilotrun`` (also ``torchrun -m pilotrun``)."""
from .cli import main

raise SystemExit(main())
