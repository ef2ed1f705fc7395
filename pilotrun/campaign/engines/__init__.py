"""What runs a campaign's runs: local worker processes (the default) or Ray tasks (``--engine ray``).

The orchestrator (``campaign/orchestrate.py``) plans the runs, writes their rows and decides their
ends; an engine only starts each run somewhere and reports back. The interface is
:class:`pilotrun.campaign.engines.base.Engine`; the Ray engine is in ``engines/ray.py`` and is
imported only when asked for, so Ray stays an optional extra.
"""
