"""One-line pilotrun callbacks for the frameworks that own the training loop.

``pilotrun.integrations.transformers.PilotrunCallback`` (``transformers.Trainer``, so TRL's ``SFTTrainer``)
and ``pilotrun.integrations.lightning.PilotrunCallback`` (Lightning 2.x); for a loop the user writes, one call after
the library set its objects up: ``pilotrun.integrations.accelerate.begin`` and ``pilotrun.integrations.fabric.begin``
(Lightning Fabric). Nothing is imported here: importing pilotrun never imports a framework; each submodule imports
its own, and the Lightning and Fabric ones say how to install it when it is missing. What they share (the probe
gates, the stage spans, the update window) is in :mod:`pilotrun.integrations.common`.
"""
