from pipespec.server.parsers.markup import Tag, TagSplitter, held_tail
from tests.server.parsers.conftest import splits


def test_held_tail_is_the_longest_partial_tag():
    assert held_tail("abc <thi", ("<think>",)) == 4
    assert held_tail("abc <think>", ("<think>",)) == 0        # a whole tag is not held
    assert held_tail("a <", ("<think>", "</think>")) == 1
    assert held_tail("a </", ("<think>", "</think>")) == 2
    assert held_tail("plain", ("<think>",)) == 0


def test_splitter_gives_the_same_items_for_every_split():
    text = "a <b> c </b><b><b d </b"
    tags = ("<b>", "</b>")
    want = None
    for pieces in splits(text):
        s = TagSplitter(tags)
        items = [x for p in pieces for x in s.feed(p)] + s.finish()
        # adjacent text items join; tags stay where they are
        merged = []
        for x in items:
            if not isinstance(x, Tag) and merged and not isinstance(merged[-1], Tag):
                merged[-1] += x
            else:
                merged.append(x)
        got = [(isinstance(x, Tag), str(x)) for x in merged]
        if want is None:
            want = got
        assert got == want, pieces
    assert want == [(False, "a "), (True, "<b>"), (False, " c "), (True, "</b>"), (True, "<b>"),
                    (False, "<b d </b")]


def test_splitter_never_releases_a_partial_tag():
    s = TagSplitter(("<tool_call>",))
    assert s.feed("hello <tool_") == ["hello "]
    assert s.feed("cal") == []
    assert s.feed("l>x") == [Tag("<tool_call>"), "x"]
    assert s.feed("<to") == []
    assert s.finish() == ["<to"]          # the output ended: a partial tag is just text
