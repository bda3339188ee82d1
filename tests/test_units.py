import pytest

from memfit.errors import MemfitError
from memfit.units import format_size, parse_size


@pytest.mark.parametrize("text, value", [("24GiB", 24 * 2**30), ("24GB", 24 * 10**9), ("80G", 80 * 2**30),
                                         ("512MiB", 512 * 2**20), ("1.5GiB", 3 * 2**29), ("4096", 4096),
                                         (" 2 tb ", 2 * 10**12)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "GiB", "-1GiB", "0", "12 parsecs", "1e3GB"])
def test_parse_size_rejects(text):
    with pytest.raises(MemfitError, match="24GiB"):
        parse_size(text)


def test_format_size():
    assert format_size(24 * 2**30) == "24.00 GiB"
    assert format_size(512) == "512 B"
    assert format_size(-3 * 2**20) == "-3.00 MiB"
