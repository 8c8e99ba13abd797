"""vast.ai's limits read from its OpenAPI files (``cloud/vastdoc.py``): the one table that both the
emulator's limiter and the client's pace come from."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pytest_ppsmoke.cloud import vastdoc
from pytest_ppsmoke.cloud.emulator.server import FakeVast
from pytest_ppsmoke.cloud.vast import PACE_MARGIN, VastClient
from pytest_ppsmoke.cloud.vastdoc import RateLimit
from pytest_ppsmoke.protocol import VAST_ENDPOINTS

from .smoke import KEY

pytestmark = pytest.mark.local


def test_the_table_is_read_from_the_vendored_files_by_endpoint_name() -> None:
    limits = vastdoc.rate_limits(scale=1, folder=vastdoc.DOCS)
    assert limits == {
        "create": RateLimit(4.5, 12.0),
        "show": RateLimit(2.0),
        "list": RateLimit(1.0),
        "label": RateLimit(1.0),
        "destroy": RateLimit(3.0),
        "search": RateLimit(requests=10, window=60.0),
    }
    assert set(vastdoc.endpoints(vastdoc.DOCS)) <= set(VAST_ENDPOINTS.values())
    inputs = vastdoc.input_limits(vastdoc.DOCS)
    assert inputs["create"]["label"]["max_length"] == 256 and inputs["label"]["label"]["max_length"] == 1024
    assert vastdoc.pace(scale=0.5, folder=vastdoc.DOCS)["create"] == (1, 2.25)
    assert vastdoc.pace(scale=1, folder=vastdoc.DOCS)["search"] == (10, 60.0)


async def test_a_changed_threshold_in_a_copy_moves_the_emulator_and_the_client_alike(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copy = tmp_path / "openapi"
    shutil.copytree(vastdoc.DOCS, copy)
    create = copy / "create_instance.yaml"
    text = create.read_text()
    assert "  threshold: 4.5\n  penalty: 12\n" in text
    create.write_text(text.replace("  threshold: 4.5\n  penalty: 12\n", "  threshold: 7.5\n  penalty: 20\n"))
    monkeypatch.setenv(vastdoc.ENV_DIR, str(copy))
    monkeypatch.setenv(vastdoc.ENV_SCALE, "1")
    assert vastdoc.rate_limits()["create"] == RateLimit(7.5, 20.0)
    fake = FakeVast(api_key=KEY)  # its limits: the failpoint's default, the documented table
    assert fake.limiter.limits["create"] == RateLimit(7.5, 20.0)
    assert VastClient(KEY, "http://127.0.0.1:9").pace["create"] == pytest.approx(7.5 * PACE_MARGIN)
    monkeypatch.setenv(vastdoc.ENV_SCALE, "0.1")  # the suite's time scale: both sides again
    assert FakeVast(api_key=KEY).limiter.limits["create"] == RateLimit(0.75, 2.0)
    assert VastClient(KEY, "http://127.0.0.1:9").pace["create"] == pytest.approx(0.75 * PACE_MARGIN)
    monkeypatch.setenv(vastdoc.ENV_SCALE, "0")
    with pytest.raises(ValueError, match="PP_VAST_TIME_SCALE"):
        vastdoc.time_scale()
