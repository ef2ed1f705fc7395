"""The building blocks of a training loop: loss normalisation, evaluation, optimizers, data order, seeding.

The loop that drives them is a driver (:mod:`pilotrun.drivers.loop`).
"""
