"""Helpers for tag-delimited markup scanned incrementally.

Text arrives in pieces that may end inside a tag (`<thi` of `<think>`), also several tokens at once
under speculation. A scanner never acts on a partial tag: it holds back the shortest tail that could
still grow into one of the tags it waits for and looks at it again with the next piece."""
from __future__ import annotations


def held_tail(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `tags` (0 if none)."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


def find_first(text: str, tags: tuple[str, ...], start: int = 0) -> tuple[int, str | None]:
    """(position, tag) of the earliest of `tags` in text[start:], or (-1, None)."""
    best, found = -1, None
    for tag in tags:
        at = text.find(tag, start)
        if at >= 0 and (best < 0 or at < best):
            best, found = at, tag
    return best, found


class TagSplitter:
    """Splits a stream of text at complete occurrences of `tags`.

    `feed(piece)` returns the text that is safe to act on now as a list of items: strings (plain text)
    and `Tag(tag)` markers; a tail that may be the start of a tag is held until the next call.
    `finish()` returns what was held (plain text: a partial tag at the very end is just text)."""

    def __init__(self, tags: tuple[str, ...]):
        if not tags or any(not t for t in tags):
            raise ValueError("TagSplitter needs non-empty tags")
        self.tags = tags
        self._buf = ""

    def feed(self, piece: str) -> list:
        buf = self._buf + piece
        out: list = []
        while True:
            at, tag = find_first(buf, self.tags)
            if tag is None:
                break
            if at:
                out.append(buf[:at])
            out.append(Tag(tag))
            buf = buf[at + len(tag):]
        keep = held_tail(buf, self.tags)
        if len(buf) > keep:
            out.append(buf[:len(buf) - keep])
        self._buf = buf[len(buf) - keep:]
        return out

    def finish(self) -> list:
        buf, self._buf = self._buf, ""
        return [buf] if buf else []


class Tag(str):
    """A complete tag found in the stream (a str subclass, told apart from text by its type)."""
    __slots__ = ()
