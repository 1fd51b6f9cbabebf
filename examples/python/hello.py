#!/usr/bin/env python3
"""hpshard from Python: version, devices, and a stream/event round trip.

Run with the package on the path, e.g. from a build tree:
    PYTHONPATH=<build>/bindings/python python3 examples/python/hello.py
"""

import numpy as np

import hpshard
from hpshard import DeviceType


def main() -> None:
    print(f"hpshard {hpshard.version()} (python)")

    for device_type in DeviceType:
        count = hpshard.device_count(device_type)
        print(f"{device_type.name.lower()}: {count} device(s)")
        for index in range(count):
            p = hpshard.device_properties(device_type, index)
            major, minor = p.compute_capability
            print(f"  [{index}] {p.name}: {p.total_memory_bytes / 2**30:.1f} GiB, "
                  f"{p.multiprocessor_count} multiprocessors, compute capability {major}.{minor}")

    src = np.arange(1 << 16, dtype=np.float32)
    dst = np.zeros_like(src)
    hpshard.host_sync_reset()
    with hpshard.Stream(DeviceType.CPU, 0) as stream, hpshard.Event(DeviceType.CPU, 0) as done:
        hpshard.memcpy_async(dst, src, stream)  # returns at once
        done.record(stream)
        print(f"copy done right after enqueueing: {done.query()}")
        stream.synchronize()  # one host sync
        print(f"copy done after synchronize: {done.query()}")
    if not np.array_equal(dst, src):
        raise SystemExit("round trip: the copy is wrong")
    print(f"round trip: copied {src.nbytes} bytes, "
          f"host syncs on this thread: {hpshard.host_sync_count_thread()}")


if __name__ == "__main__":
    main()
