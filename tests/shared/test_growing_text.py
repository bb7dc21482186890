from shared.growing_text import GrowingText


def test_pieces_read_back_whole_from_a_position_and_cut():
    text = GrowingText()
    for piece in ["ab", "", "cde", "f", "ghij"]:
        text.append(piece)
    assert (len(text), text.value()) == (10, "abcdefghij")
    text.append("k")
    assert [text.since(i) for i in (0, 3, 4, 9, 11, 15)] == [
        "abcdefghijk",
        "defghijk",
        "efghijk",
        "jk",
        "",
        "",
    ]
    text.cut(4)
    assert (len(text), text.value(), text.since(2)) == (4, "abcd", "cd")
    text.append("xy")
    assert text.value() == "abcdxy"
    text.cut(0)
    assert (len(text), text.value()) == (0, "")
