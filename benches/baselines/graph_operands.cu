// Which operands cuGraphExecMemcpyNodeSetParams takes for a copy node made with local device
// memory (cuMemAlloc -> cuMemAlloc): another local allocation, memory of another process mapped
// with cuIpcOpenMemHandle (written and read), that memory on both ends, and pinned host memory;
// each set, launched and synchronized, with the memory types DEVICE and then UNIFIED. The
// exporter prints what the importer's graph wrote into its memory. Two processes on GPU 0:
//
//   nvcc -O2 -o graph_operands benches/baselines/graph_operands.cu -lcuda
//   ./graph_operands export /tmp/h.bin & sleep 2; ./graph_operands import /tmp/h.bin; wait
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#define CK(x) do { CUresult r = (x); if (r) { printf("%s: %d\n", #x, r); exit(1); } } while (0)
static CUDA_MEMCPY3D piece(CUdeviceptr dst, CUdeviceptr src, size_t n) {
  CUDA_MEMCPY3D p; memset(&p, 0, sizeof p);
  p.srcMemoryType = CU_MEMORYTYPE_DEVICE; p.srcDevice = src; p.srcPitch = n; p.srcHeight = 1;
  p.dstMemoryType = CU_MEMORYTYPE_DEVICE; p.dstDevice = dst; p.dstPitch = n; p.dstHeight = 1;
  p.WidthInBytes = n; p.Height = 1; p.Depth = 1; return p;
}
static CUDA_MEMCPY3D upiece(CUdeviceptr dst, CUdeviceptr src, size_t n) {
  CUDA_MEMCPY3D p = piece(dst, src, n); p.srcMemoryType = CU_MEMORYTYPE_UNIFIED; p.dstMemoryType = CU_MEMORYTYPE_UNIFIED; return p;
}
int main(int argc, char** argv) {
  CK(cuInit(0)); CUdevice dev; CK(cuDeviceGet(&dev, 0)); CUcontext ctx; CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  if (argc > 1 && !strcmp(argv[1], "export")) {
    CUdeviceptr m; CK(cuMemAlloc(&m, 1 << 20)); CK(cuMemsetD8(m, 0x5A, 1 << 20));
    CUipcMemHandle h; CK(cuIpcGetMemHandle(&h, m));
    FILE* f = fopen(argv[2], "wb"); fwrite(&h, sizeof h, 1, f); fclose(f);
    sleep(6);
    unsigned char b[16]; CK(cuMemcpyDtoH(b, m + 4096, 16)); printf("exporter sees %02x at 4096 (0x11 if the graph wrote)\n", b[0]);
    return 0;
  }
  CUipcMemHandle h; FILE* f = fopen(argv[2], "rb"); if (fread(&h, sizeof h, 1, f) != 1) return 3; fclose(f);
  CUdeviceptr rem; CK(cuIpcOpenMemHandle(&rem, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
  CUdeviceptr a, b, c; CK(cuMemAlloc(&a, 1 << 20)); CK(cuMemAlloc(&b, 1 << 20)); CK(cuMemAlloc(&c, 1 << 20));
  CK(cuMemsetD8(a, 0x11, 1 << 20)); CK(cuMemsetD8(b, 0, 1 << 20));
  void* host; CK(cuMemHostAlloc(&host, 1 << 20, 0));
  CUstream s; CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  const char* kinds[] = {"DEVICE types", "UNIFIED types"};
  for (int k = 0; k < 2; k++) {
    CUDA_MEMCPY3D (*mk)(CUdeviceptr, CUdeviceptr, size_t) = k ? upiece : piece;
    CUgraph g; CUgraphNode node; CUgraphExec x;
    CK(cuGraphCreate(&g, 0));
    CUDA_MEMCPY3D p0 = mk(b, a, 4096);  // made with local -> local
    CK(cuGraphAddMemcpyNode(&node, g, NULL, 0, &p0, ctx));
    CK(cuGraphInstantiate(&x, g, 0));
    struct { const char* what; CUdeviceptr dst, src; } t[] = {
      {"local -> other local alloc", c, a}, {"local -> IPC (write)", rem + 4096, a + 4096},
      {"IPC -> local (read)", b + 8192, rem}, {"IPC -> IPC", rem + 8192, rem + 12288},
      {"local -> host (device ptr of pinned)", (CUdeviceptr)host, a},
    };
    for (int i = 0; i < 5; i++) {
      CUDA_MEMCPY3D p = mk(t[i].dst, t[i].src, 4096);
      CUresult e = cuGraphExecMemcpyNodeSetParams(x, node, &p, ctx);
      CUresult l = e ? (CUresult)-1 : cuGraphLaunch(x, s);
      CUresult sy = cuStreamSynchronize(s);
      printf("%s: %-40s set %d launch %d sync %d\n", kinds[k], t[i].what, e, l, sy);
    }
    unsigned char v[2]; CK(cuMemcpyDtoH(&v[0], b + 8192, 1)); CK(cuMemcpyDtoH(&v[1], c, 1));
    printf("  read landed: %02x (5a), local->other: %02x (11)\n", v[0], v[1]);
    CK(cuGraphExecDestroy(x)); CK(cuGraphDestroy(g));
  }
  return 0;
}
