"""The low-level SWIG module hpshard.capi: a class per C handle whose methods are the C
functions (bindings/swig/hpshard.i), module functions for the rest, outputs returned,
failing statuses raised as hpshard.Error, NULL handle arguments (None) rejected by the
library, buffers checked against counts."""

import pathlib
import sys

import numpy as np
import pytest

import hpshard
from hpshard import capi

ROOT = pathlib.Path(__file__).resolve().parents[3]
HEADER = ROOT / "capi" / "include" / "hpshard" / "hpshard.h"
sys.path.insert(0, str(ROOT / "tests" / "bindings"))
import swig_map  # noqa: E402


def test_every_c_function_is_wrapped():
    names = swig_map.header_functions(HEADER)
    assert len(names) >= 100
    wrapped = swig_map.binding_map()
    missing = []
    for name in names:
        members = wrapped.get(name, [])
        ok = False
        for cls, member in members:
            owner = capi if cls is None else getattr(capi, cls, None)
            attr = "__swig_destroy__" if member == "~" else member
            ok |= owner is not None and callable(getattr(owner, attr, None))
        if not ok:
            missing.append(name)
    assert not missing, f"not wrapped in hpshard.capi: {missing}"


def test_allow_list_hides_sentinels_and_raw_functions():
    assert not hasattr(capi, "HPS_STATUS_FORCE32")
    assert not hasattr(capi, "HPS_DTYPE_FORCE32")
    # The handle functions are methods; the C names are not module functions.
    assert not hasattr(capi, "hps_comm_rank") and not hasattr(capi, "hps_engine_step")


def test_status_codes_match_the_header():
    assert capi.HPS_STATUS_OK == 0
    assert capi.HPS_STATUS_INVALID_ARGUMENT == 1
    assert capi.HPS_STATUS_OUT_OF_RANGE == 2
    assert capi.HPS_STATUS_FAILED_PRECONDITION == 5
    assert capi.HPS_STATUS_BACKEND_ERROR == 12
    for s in hpshard.Status:
        assert getattr(capi, "HPS_STATUS_" + s.name) == s.value


def test_infallible_queries():
    assert capi.hps_version_string() == capi.HPS_VERSION_STRING
    assert capi.hps_version_number() == capi.HPS_VERSION_NUMBER
    assert capi.hps_status_string(capi.HPS_STATUS_OK)
    assert isinstance(capi.hps_last_error_message(), str)


def test_outputs_become_return_values():
    assert capi.dtype_size(capi.HPS_DTYPE_FLOAT64) == 8
    assert capi.dtype_name(capi.HPS_DTYPE_UINT8) == "uint8"
    assert capi.device_count(capi.HPS_DEVICE_CPU) == 1
    props = capi.device_get_properties(capi.HPS_DEVICE_CPU, 0)
    assert props.struct_size == capi.properties_struct_size()
    assert props.type == capi.HPS_DEVICE_CPU and props.index == 0
    assert capi.device_properties_init(capi.properties_struct_size()).struct_size \
        == capi.properties_struct_size()
    assert isinstance(capi.host_sync_count_thread(), int)
    assert isinstance(capi.host_sync_count_total(), int)
    assert capi.host_sync_reset() is None
    count, ns = capi.dependency_wait_stats()
    assert count >= 0 and ns >= 0


def test_failing_status_raises_error_with_code_and_message():
    with pytest.raises(hpshard.Error) as info:
        capi.dtype_size(99)
    assert info.value.status == capi.HPS_STATUS_INVALID_ARGUMENT
    assert "hps_dtype_size" in info.value.message
    assert capi.hps_last_error_message() == info.value.message


def test_struct_init_rejects_a_small_struct():
    for init in (capi.device_properties_init, capi.rendezvous_info_init,
                 capi.comm_options_init, capi.clip_options_init, capi.engine_options_init):
        with pytest.raises(hpshard.Error) as info:
            init(3)
        assert info.value.status == capi.HPS_STATUS_INVALID_ARGUMENT
        assert "smaller than the first released" in info.value.message


def test_null_handle_arguments_are_rejected():
    s = capi.StreamHandle.create(capi.HPS_DEVICE_CPU, 0)
    e = capi.EventHandle.create(capi.HPS_DEVICE_CPU, 0)
    null_calls = [
        lambda: s.wait_event(None),
        lambda: e.record(None),
        lambda: capi.CommHandle.create(None, 0, 1, capi.HPS_DEVICE_CPU, 0, None),
        lambda: capi.EngineHandle.create(None, None, None),
        lambda: capi.HybridGroupHandle.create(None, None),
    ]
    for call in null_calls:
        with pytest.raises(hpshard.Error) as info:
            call()
        assert info.value.status == capi.HPS_STATUS_INVALID_ARGUMENT
        assert "is NULL" in info.value.message


def test_handles_are_owned_and_destroyed_once():
    s = capi.StreamHandle.create(capi.HPS_DEVICE_CPU, 0)
    assert s.thisown  # the proxy owns the handle: its destructor destroys it
    type(s).__swig_destroy__(s)  # what hpshard.Handle.close does
    assert not s.thisown  # disowned: garbage collection does not destroy it again
    del s


def test_raw_round_trip():
    s = capi.StreamHandle.create(capi.HPS_DEVICE_CPU, 0)
    e = capi.EventHandle.create(capi.HPS_DEVICE_CPU, 0)
    src = np.arange(16, dtype=np.int32)
    dst = np.zeros_like(src)
    s.memcpy_async(dst, src, src.nbytes)
    s.memcpy_async(None, None, 0)  # bytes == 0: no-op
    with pytest.raises(hpshard.Error) as info:  # NULL pointer with bytes > 0
        s.memcpy_async(None, None, 4)
    assert info.value.status == capi.HPS_STATUS_INVALID_ARGUMENT
    e.record(s)
    s.wait_event(e)
    e.synchronize()
    assert e.query() == 1
    s.synchronize()
    np.testing.assert_array_equal(dst, src)


def test_raw_buffers_are_checked_against_counts_and_writability():
    s = capi.StreamHandle.create(capi.HPS_DEVICE_CPU, 0)
    src = np.ones(8, dtype=np.uint8)
    with pytest.raises(ValueError):
        s.memcpy_async(np.zeros(4, dtype=np.uint8), src, 8)
    with pytest.raises(ValueError):
        s.memcpy_async(np.zeros(8, dtype=np.uint8), src, 9)
    with pytest.raises(ValueError):
        s.memcpy_async(b"read-only", src, 1)
    s.synchronize()
    clip = capi.ClipHandle.create(None, None, None, None)  # default options
    g = np.zeros(2, np.float32)
    with pytest.raises(ValueError):  # 3 float32 do not fit in 2
        clip.add_tensor(g, 3, capi.HPS_DTYPE_FLOAT32, 0)
    with pytest.raises(ValueError):  # read-only
        clip.add_tensor(bytes(8), 2, capi.HPS_DTYPE_FLOAT32, 0)
    with pytest.raises(hpshard.Error) as info:  # NULL data: the library refuses it
        clip.add_tensor(None, 2, capi.HPS_DTYPE_FLOAT32, 0)
    assert info.value.status == capi.HPS_STATUS_INVALID_ARGUMENT


def test_dlpack_arguments_are_capsules():
    clip = capi.ClipHandle.create(None, None, None, None)
    with pytest.raises(TypeError):
        clip.add_tensor_dlpack(np.zeros(2, np.float32), 0)  # an array, not its capsule
    clip.add_tensor_dlpack(np.zeros(2, np.float32).__dlpack__(), 0)
    with pytest.raises(hpshard.Error) as info:
        clip.add_tensor_dlpack(None, 0)
    assert "gradient is NULL" in info.value.message
    with pytest.raises(TypeError):
        capi.dlpack_host_data("not a capsule")
    a = np.arange(3, dtype=np.float64)
    assert capi.dlpack_host_data(a.__dlpack__()) == a.ctypes.data
