"""Device profiles a user wrote or edited: every number they hold is checked where the file is
loaded (server/perf/devices.load_profile), the calibration's tables too."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("table, key, value, says", [
    ("flop_ns", 1, -5.0, "calibration.gemm.float32.flop_ns.1 must be finite and >= 0, got -5.0"),
    ("flop_ns", 1, float("nan"), "calibration.gemm.float32.flop_ns.1 must be finite and >= 0"),
    ("weight_ns", 262144, float("inf"), "weight_ns.262144 must be finite and >= 0, got inf"),
])
def test_a_calibrated_profile_with_a_table_that_cannot_price_a_step_is_one_line(tmp_path, table,
                                                                              key, value, says):
    """The calibration's numbers went unchecked: a negative GEMM ns was "step 0: ends at -0.02
    before it starts" as a traceback, a NaN one hung the simulated run (SIGTERM did not stop it)."""
    import yaml
    from batchsim.configs import CONFIG_DIR, ConfigError
    from batchsim.server.perf.devices import load_profile

    data = yaml.safe_load((CONFIG_DIR / "devices" / "linux-x86_64-openblas-2core.yaml").read_text())
    data["calibration"]["gemm"]["float32"][table][key] = value
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as err:
        load_profile(path)
    assert says in str(err.value), err.value
