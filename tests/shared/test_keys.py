"""Secret material read from flags: a path must name a file, keys decode or are refused in one line."""

from __future__ import annotations

import pytest

from shared.errors import LmserveError
from shared.keys import machine_kv_secret, public_keys, read_secret, secret_key


def test_a_secret_given_as_a_path_must_exist(tmp_path):
    with pytest.raises(LmserveError, match="no such file"):
        read_secret(str(tmp_path / "kv-secret-that-was-never-mounted"), "--kv-secret")
    (tmp_path / "kv-secret").write_text("0123456789abcdef0123\n")
    assert read_secret(str(tmp_path / "kv-secret"), "--kv-secret") == b"0123456789abcdef0123"
    assert read_secret("a-secret-from-the-environment", "--kv-secret") == b"a-secret-from-the-environment"
    with pytest.raises(LmserveError, match="at least 16"):
        read_secret("short", "--kv-secret")


def test_the_machine_secret_is_made_once_and_kept(tmp_path):
    first = machine_kv_secret(tmp_path)
    assert len(first) == 64 and machine_kv_secret(tmp_path) == first
    assert (tmp_path / "kv-secret").stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["kv-secret"]  # no partial file left behind


@pytest.mark.parametrize("text", ["#" * 40, "not a key", "~" * 40])
def test_text_that_is_no_key_is_refused_in_one_line(text):
    with pytest.raises(LmserveError, match="--wire-key"):
        secret_key(text, "--wire-key")
    with pytest.raises(LmserveError, match="--wire-allow"):
        public_keys([text], "--wire-allow")
