"""Markdown table cells show their text as it is: one line, nothing that ends the cell or starts a code span,
emphasis, a link or a tag; a table's lines from its header and rows."""

import re

from rlhf_core.data.markdown import markdown_table, table_cell


def test_a_cell_is_one_line_with_its_pipes_and_backticks_escaped():
    assert table_cell("-> multiply\n<- multiply: 6\r\n6") == "-> multiply<br><- multiply: 6<br>6"
    assert table_cell("a | b") == "a \\| b" and table_cell("`code`") == "\\`code\\`"
    assert table_cell("2*3*4 = my_answer ~x~ [x](y)") == "2\\*3\\*4 = my\\_answer \\~x\\~ \\[x\\](y)"
    assert table_cell("C:\\path") == "C:\\\\path"  # a backslash stays a backslash


def test_a_tag_the_renderer_would_hide_is_shown_and_an_arrow_is_left_alone():
    assert table_cell("<tool_call>81831") == "&lt;tool\\_call>81831"
    assert table_cell("</s> and <!-- x") == "&lt;/s> and &lt;!-- x"
    assert table_cell("<- f: 2") == "<- f: 2" and table_cell("1 < 2") == "1 < 2"


def test_none_and_numbers_are_cells_too():
    assert table_cell(None) == "" and table_cell(0.5) == "0.5" and table_cell("  padded \n") == "padded"


def test_a_table_has_its_header_its_rule_and_a_line_per_row_whatever_the_cells_hold():
    lines = markdown_table(("prompt", "after"), [("2*3=", "-> f {}\n<- f: 6\n6"), ("a|b", None)])
    assert lines == [
        "| prompt | after |",
        "|---|---|",
        "| 2\\*3= | -> f {}<br><- f: 6<br>6 |",
        "| a\\|b |  |",
    ]
    assert all(len(re.split(r"(?<!\\)\|", line)) == 4 for line in lines)  # two cells each: no pipe ends one early
