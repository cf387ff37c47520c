"""Helpers for the parser tests: feeding a text in pieces, at every split point or at random ones."""
import random


def splits(text: str, seed: int = 0, random_splits: int = 30):
    """Ways to cut `text` into pieces: whole, one piece per character, two pieces at every split
    point, and random cuts into 2-8 pieces (a speculative step hands over several tokens at once)."""
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    rng = random.Random(seed)
    for _ in range(random_splits):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 7))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
