"""Stop strings on a stream of text: release what cannot be the start of a stop string."""

from __future__ import annotations

from shared.conventions.reasoning import partial_suffix


class StopStringMatcher:
    """Feed text pieces; get back the text safe to emit, and which stop string fired (if any).

    Text that might be the beginning of a stop string is held back until the next piece shows
    whether it is; text from the first stop string on is never released.
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.fired: str | None = None

    def push(self, text: str) -> str:
        if self.fired is not None:
            return ""
        if not self.stops:
            return text
        buffer = self.held + text
        hit_at, hit = len(buffer) + 1, None
        for stop in self.stops:
            position = buffer.find(stop)
            if position != -1 and position < hit_at:
                hit_at, hit = position, stop
        if hit is not None:
            self.fired = hit
            self.held = ""
            return buffer[:hit_at]
        keep = self._partial_suffix(buffer)
        self.held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[:len(buffer) - keep]

    def flush(self) -> str:
        """End of stream: whatever was held back was not a stop string after all."""
        out, self.held = ("" if self.fired else self.held), ""
        return out

    def _partial_suffix(self, buffer: str) -> int:
        return partial_suffix(buffer, self.stops)


