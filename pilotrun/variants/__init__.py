"""``pilotrun variants``: the memory fixes of docs/guides/fix-memory.md run beside the control and measured
(:mod:`.run`), what each holds and changes (:mod:`.define`), and the comparison with the control (:mod:`.judge`)."""
