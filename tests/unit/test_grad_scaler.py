"""The fp16 dynamic loss scaler skips, backs off and grows."""
from megatron_sp.optim.grad_scaler import DynamicLossScaler


def test_backoff_after_hysteresis_then_growth():
    s = DynamicLossScaler(scale=1024.0, growth_interval=3, hysteresis=2)
    s.update(found_inf=True)
    assert s.scale == 1024.0                     # first overflow absorbed by hysteresis
    s.update(found_inf=True)
    assert s.scale == 512.0                      # second consecutive one backs off
    for _ in range(2):
        s.update(found_inf=False)
    assert s.scale == 512.0
    s.update(found_inf=False)
    assert s.scale == 1024.0                     # grew after 3 clean steps
    assert s.inv_scale == 1 / 1024.0


def test_min_scale_and_disabled():
    s = DynamicLossScaler(scale=2.0, hysteresis=1, min_scale=1.0)
    for _ in range(5):
        s.update(found_inf=True)
    assert s.scale == 1.0
    off = DynamicLossScaler(enabled=False)
    off.update(found_inf=True)
    assert off.scale == 1.0 and off.inv_scale == 1.0


def test_state_round_trip():
    s = DynamicLossScaler(scale=64.0, growth_interval=5)
    s.update(False)
    s.update(True)
    t = DynamicLossScaler()
    t.load_state_dict(s.state_dict())
    assert t == s
