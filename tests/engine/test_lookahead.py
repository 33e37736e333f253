"""Router lookahead (spec §6): each target's router after that target's own norm, and the router's
probabilities handed to the core."""

from __future__ import annotations

import numpy as np

from tests.conftest import ModelFactory
from tokenwing.compute.ggml_lib import Graph, to_numpy
from tokenwing.models import common
from tokenwing.runtime.session import Session, SessionOptions


def test_each_target_sees_its_own_norm(repacked_factory: ModelFactory) -> None:
    """Layer 0 predicts layers 1 and 2 from one input: layer 2's logits must be its router applied after layer
    2's norm (not layer 1's, as before), to F16 rounding; and the predictions carry softmax probabilities."""
    model = repacked_factory(type="F32", n_layer=3, n_expert=16, n_expert_used=4)
    s = Session(str(model), SessionOptions(n_ctx=64, lookahead=2), log=lambda line: None)
    try:
        m, la = s.model, s.lookahead
        n1, n2 = (to_numpy(m.router_norm(t)).reshape(-1) for t in (1, 2))
        assert np.abs(n1 - n2).max() > 1e-3  # the two norms differ: the test can tell them apart
        x = np.random.default_rng(0).standard_normal((1, s.hp.n_embd)).astype(np.float32)
        g = Graph(1 << 24, 1)
        try:
            lo = common.LayerOut(writes=[], out=g.input(x))
            ahead = la.graph(g.ctx, 0, lo)
            assert ahead is not None
            g.compute(ahead)
            got = to_numpy(ahead).reshape(1, -1)
        finally:
            g.close()
        normed = x / np.sqrt(np.mean(x.astype(np.float64) ** 2) + s.hp.rms_eps)
        for d, (target, norm) in enumerate(((1, n1), (2, n2))):
            router = m.weights.array(m.router_weight_name(target))
            want = router @ (normed[0] * norm)
            wrong = router @ (normed[0] * n1)
            part = got[0, d * 16 : (d + 1) * 16]
            assert np.abs(part - want).max() < 2e-2 * np.abs(want).max()
            if target == 2:
                assert np.abs(part - want).max() < np.abs(part - wrong).max()
        made = la.predict(0, got)
        assert [a.target for a in made] == [1, 2] and [a.distance for a in made] == [1, 2]
        for a in made:
            p = np.exp(got[0, (a.distance - 1) * 16 : a.distance * 16].astype(np.float64))
            p /= p.sum()
            assert np.allclose(a.probs, p[a.experts]) and a.probs == sorted(a.probs, reverse=True)
    finally:
        s.close()
