"""The rented node: a lock as a requirements file (``requirements.py``) and a plan as a SkyPilot task
(``skypilot.py``). Pure functions from plan rows and locks to text; the CLI writes the files."""
