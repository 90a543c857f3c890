"""Ctrl-C during the commands that only read runs (compare, ls, sample): one line and exit 130, no traceback.
(Ctrl-C during training is tests/test_failures.py's.)"""

import pytest

import normlab.cli as cli


@pytest.mark.parametrize("command", ["compare", "ls", "sample"])
def test_ctrl_c_in_a_reading_command_is_one_line_and_exit_130(command, monkeypatch, capsys):
    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setitem(cli.READERS, command, lambda: interrupted)
    assert cli.main([command, "somewhere"]) == 130
    out, err = capsys.readouterr()
    assert out == "" and err == f"normlab: {command} interrupted\n"


@pytest.mark.parametrize("command", ["compare", "ls", "sample"])
def test_each_reading_command_reaches_its_own_main(command, capsys):
    try:
        cli.main([command, "--help"])
    except SystemExit as stop:  # argparse's --help
        assert stop.code == 0
    assert f"normlab {command}" in capsys.readouterr().out
