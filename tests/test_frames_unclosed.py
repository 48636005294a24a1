"""Counting a frame's values never rescans it from every quote (third audit: a reply of a
million commas then ``"\\"\\"\\"…`` never closed, 80 KB of it, held the whole kernel for 52 s
in ``values_in``'s string pattern, which failed from each quote after scanning to the end)."""

from __future__ import annotations

from smolbench.gate import frames


def test_a_string_never_closed_is_one_match_from_its_quote_to_the_frames_end() -> None:
    for tail in (b"", b"\\"):
        frame = b"[" + b"," * 1000 + b'"' + b'\\"' * 5000 + tail
        matches = list(frames.JSON_STRING.finditer(frame))
        assert [(m.start(), m.end()) for m in matches] == [(1001, len(frame))]  # no retry from the later quotes


def test_a_frame_past_the_item_limit_is_counted_from_its_text() -> None:
    n = frames.LIMITS.max_items + 10
    frame = b"[" + b",".join([b"1"] * n) + b"]"
    assert frames.values_in(frame) == n + 1
    quoted = b'["' + b"," * (n + 5) + b'"]'
    assert frames.values_in(quoted) == 2  # the array and its one string


def test_a_frame_is_counted_a_part_at_a_time_as_it_was_at_once() -> None:
    """Stripped of its strings at once, a frame of 1.7 million empty strings (5 MB) held 300 MB
    while its values were counted (re.sub's ~180 bytes a string); a part at a time it holds
    little, and every count is the one the whole-frame strip gives."""
    import random
    import tracemalloc

    def at_once(frame: bytes) -> int:
        bare = frames.JSON_STRING.sub(b'""', frame)
        return 1 + bare.count(b",") + bare.count(b"[") + bare.count(b"{") - bare.count(b"[]") - bare.count(b"{}")

    rnd = random.Random(0)
    for _ in range(3000):
        frame = bytes(rnd.choice(b'"\\,[]{}a ') for _ in range(rnd.randrange(60)))
        assert frames.values_in(frame, 0) == at_once(frame), frame
    for frame in (b'["' + b"a," * 5000 + b'",' + b"[]," * 9000 + b'"x"]', b'"' + b'\\"' * 9000 + b"\\"):
        assert frames.values_in(frame, 0) == at_once(frame)
    empty = b"[" + b'"",' * 1_700_000 + b"1]"
    tracemalloc.start()
    try:
        assert frames.values_in(empty) == 1_700_002
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8_000_000, f"{peak:,} bytes held to count a frame of {len(empty):,}"
