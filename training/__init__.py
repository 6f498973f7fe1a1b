"""Offline work on cartridges: self-study, training and fleet indexes (``lmserve cartridge``)."""
