"""``pilotrun variants``: SPEC §4's memory fixes run beside the control and measured (:mod:`.run`), what each holds
and changes (:mod:`.define`), and the comparison with the control (:mod:`.judge`)."""
