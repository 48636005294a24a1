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
