"""The low-level SWIG module hpshard.capi: exact C names, out-params returned,
failing statuses raised as hpshard.Error, NULL handles (None) rejected by the library."""

import pathlib
import re

import numpy as np
import pytest

import hpshard
from hpshard import capi

HEADER = (pathlib.Path(__file__).resolve().parents[3]
          / "capi" / "include" / "hpshard" / "hpshard.h")


def c_functions():
    text = HEADER.read_text()
    return sorted(set(re.findall(r"HPS_API\s+[^;(]*?\b(hps_\w+)\s*\(", text)))


def test_every_c_function_is_wrapped_under_its_c_name():
    names = c_functions()
    assert len(names) >= 22
    missing = [n for n in names if not callable(getattr(capi, n, None))]
    assert not missing, f"not wrapped in hpshard.capi: {missing}"


def test_allow_list_hides_sentinels():
    assert not hasattr(capi, "HPS_STATUS_FORCE32")
    assert not hasattr(capi, "HPS_DTYPE_FORCE32")


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


def test_out_params_become_return_values():
    assert capi.hps_dtype_size(capi.HPS_DTYPE_FLOAT64) == 8
    assert capi.hps_dtype_name(capi.HPS_DTYPE_UINT8) == "uint8"
    assert capi.hps_device_count(capi.HPS_DEVICE_CPU) == 1
    props = capi.hps_device_get_properties(capi.HPS_DEVICE_CPU, 0)
    assert props.struct_size == capi.HPS_SWIG_PROPERTIES_STRUCT_SIZE
    assert props.type == capi.HPS_DEVICE_CPU and props.index == 0
    assert capi.hps_device_properties_init(capi.HPS_SWIG_PROPERTIES_STRUCT_SIZE).struct_size \
        == capi.HPS_SWIG_PROPERTIES_STRUCT_SIZE
    assert isinstance(capi.hps_host_sync_count_thread(), int)
    assert isinstance(capi.hps_host_sync_count_total(), int)
    assert capi.hps_host_sync_reset() is None


def test_failing_status_raises_error_with_code_and_message():
    with pytest.raises(hpshard.Error) as info:
        capi.hps_dtype_size(99)
    assert info.value.status == capi.HPS_STATUS_INVALID_ARGUMENT
    assert "hps_dtype_size" in info.value.message
    assert capi.hps_last_error_message() == info.value.message


def test_properties_init_rejects_a_small_struct():
    with pytest.raises(hpshard.Error) as info:
        capi.hps_device_properties_init(3)
    assert info.value.status == capi.HPS_STATUS_INVALID_ARGUMENT


def test_null_handles_are_rejected():
    null_calls = [
        lambda: capi.hps_stream_synchronize(None),
        lambda: capi.hps_stream_wait_event(None, None),
        lambda: capi.hps_event_record(None, None),
        lambda: capi.hps_event_query(None),
        lambda: capi.hps_event_synchronize(None),
        lambda: capi.hps_memcpy_async(None, None, 0, None),
    ]
    for call in null_calls:
        with pytest.raises(hpshard.Error) as info:
            call()
        assert info.value.status == capi.HPS_STATUS_INVALID_ARGUMENT


def test_destroy_null_is_a_no_op():
    assert capi.hps_stream_destroy(None) is None
    assert capi.hps_event_destroy(None) is None


def test_raw_round_trip():
    s = capi.hps_stream_create(capi.HPS_DEVICE_CPU, 0)
    e = capi.hps_event_create(capi.HPS_DEVICE_CPU, 0)
    try:
        src = np.arange(16, dtype=np.int32)
        dst = np.zeros_like(src)
        capi.hps_memcpy_async(dst, src, src.nbytes, s)
        capi.hps_memcpy_async(None, None, 0, s)  # bytes == 0: no-op
        with pytest.raises(hpshard.Error) as info:  # NULL pointer with bytes > 0
            capi.hps_memcpy_async(None, None, 4, s)
        assert info.value.status == capi.HPS_STATUS_INVALID_ARGUMENT
        capi.hps_event_record(e, s)
        capi.hps_stream_wait_event(s, e)
        capi.hps_event_synchronize(e)
        assert capi.hps_event_query(e) == 1
        capi.hps_stream_synchronize(s)
        np.testing.assert_array_equal(dst, src)
    finally:
        capi.hps_event_destroy(e)
        capi.hps_stream_destroy(s)


def test_raw_memcpy_checks_buffer_sizes_and_writability():
    s = capi.hps_stream_create(capi.HPS_DEVICE_CPU, 0)
    try:
        src = np.ones(8, dtype=np.uint8)
        with pytest.raises(ValueError):
            capi.hps_memcpy_async(np.zeros(4, dtype=np.uint8), src, 8, s)
        with pytest.raises(ValueError):
            capi.hps_memcpy_async(np.zeros(8, dtype=np.uint8), src, 9, s)
        with pytest.raises(ValueError):
            capi.hps_memcpy_async(b"read-only", src, 1, s)
        capi.hps_stream_synchronize(s)
    finally:
        capi.hps_stream_destroy(s)
