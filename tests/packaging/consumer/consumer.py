"""The Python consumer of an installed python3-hpshard: a one-rank engine step through
DLPack views, from the installed module only (package_test.sh checks where it came from)."""
import sys
import uuid

import numpy as np

import hpshard

store = hpshard.Store.open(f"memory://package-{uuid.uuid4().hex}", 0)
comm = hpshard.Communicator.create(store, 0, 1)
with store, comm, hpshard.Engine.create(comm, learning_rate=0.5) as engine:
    w = engine.add_param("w", (4,))
    engine.seal()
    engine.param(w)[:] = 1.0
    engine.broadcast_parameters()
    engine.wait_parameters(0)
    engine.grad_tensor(w).numpy()[:] = [0.0, 1.0, 2.0, 3.0]
    engine.grad_ready(w)
    engine.step()
    got = engine.gather_parameter(w)
    assert np.allclose(got, [1.0, 0.5, 0.0, -0.5]), got
    assert np.from_dlpack(engine.param_tensor(w))[3] == -0.5
print(f"python consumer: hpshard {hpshard.version()} from {hpshard.__file__}")
sys.exit(0)
