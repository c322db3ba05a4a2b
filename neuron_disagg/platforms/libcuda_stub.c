/*
 * A stand-in libcuda.so.1 for Trainium hosts.
 *
 * Why: NIXL's LIBFABRIC plugin links against libcuda.so.1 even where no NVIDIA GPU exists; without
 * the library the plugin does not load and KV cannot move over EFA. These are the three entry points
 * it resolves. Each answers CUDA_ERROR_NO_DEVICE (100), so the plugin treats every buffer as
 * non-CUDA memory and uses its Neuron (FI_HMEM_NEURON) or host paths.
 *
 * Built by `neuron-disagg install-fabric-libs` (fabric_libs.py, libcuda_stub.py), on the AMI into
 * /opt/neuron-disagg/lib. Only `neuron-disagg serve` and our units put that directory on
 * LD_LIBRARY_PATH: nothing else on the host sees a libcuda.
 * Never install this on a GPU host: it would hide the real driver.
 */

#define CUDA_ERROR_NO_DEVICE 100

typedef int CUresult;

CUresult cuCtxSetCurrent(void *ctx) {
    (void)ctx;
    return CUDA_ERROR_NO_DEVICE;
}

CUresult cuDeviceGetPCIBusId(char *pci_bus_id, int len, int device) {
    (void)device;
    if (pci_bus_id != 0 && len > 0) {
        pci_bus_id[0] = '\0';
    }
    return CUDA_ERROR_NO_DEVICE;
}

CUresult cuPointerGetAttributes(unsigned int num_attributes, void *attributes, void **data, unsigned long long ptr) {
    (void)num_attributes;
    (void)attributes;
    (void)data;
    (void)ptr;
    return CUDA_ERROR_NO_DEVICE;
}
