package org.hpshard;

/**
 * A copy of hps_device_properties_t for one device.
 *
 * @param type the device's type
 * @param index the device's index within its type
 * @param name "cpu (...)", "NVIDIA H200", ...
 * @param totalMemoryBytes physical memory of the device
 * @param computeCapabilityMajor CUDA only; 0 on CPU
 * @param computeCapabilityMinor CUDA only; 0 on CPU
 * @param multiprocessorCount CUDA: SMs; CPU: hardware threads
 */
public record DeviceProperties(
    DeviceType type,
    int index,
    String name,
    long totalMemoryBytes,
    int computeCapabilityMajor,
    int computeCapabilityMinor,
    int multiprocessorCount) {}
