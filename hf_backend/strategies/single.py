"""One process on one device: the base strategy as it is."""

from __future__ import annotations

from .base import Strategy


class SingleDeviceStrategy(Strategy):
    pass
