// The host cost of queueing one small device-to-device copy, five ways, on GPU 0: cuMemcpyAsync,
// cuMemcpyDtoDAsync, cudaMemcpyAsync, a copy kernel launch, cuMemcpy2DAsync. Each way queues
// 4,000 copies of 4 KiB, 64 KiB and 1 MiB, 32 at a time, synchronizing after each 32: "issue"
// is the time inside the calls per copy, "pipelined" the whole time per copy. It tells what any
// copy the transfer engine (or a hand-written loop) queues costs before the engine's own work.
//
//   nvcc -O2 -o copy_cost benches/baselines/copy_cost.cu -lcuda && ./copy_cost
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now() { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e6 + t.tv_nsec / 1e3; }
#define CK(x) do { CUresult r = (x); if (r) { printf("%s: %d\n", #x, r); exit(1); } } while (0)
__global__ void copyk(const uint4* s, uint4* d, size_t n) { for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) d[i] = s[i]; }
int main() {
  CK(cuInit(0)); CUdevice dev; CK(cuDeviceGet(&dev, 0)); CUcontext ctx; CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  size_t sizes[] = {4096, 65536, 1 << 20};
  CUdeviceptr a, b; CK(cuMemAlloc(&a, 64 << 20)); CK(cuMemAlloc(&b, 64 << 20));
  CUstream s; CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  const int N = 4000, D = 32;
  for (int k = 0; k < 3; k++) {
    size_t n = sizes[k];
    for (int way = 0; way < 5; way++) {
      // warm
      for (int i = 0; i < 100; i++) CK(cuMemcpyAsync(b, a, n, s));
      CK(cuStreamSynchronize(s));
      double issue = 0, t0 = now();
      for (int r = 0; r < N / D; r++) {
        double t1 = now();
        for (int i = 0; i < D; i++) {
          CUdeviceptr dst = b + (i % 8) * n, src = a + (i % 8) * n;
          switch (way) {
            case 0: CK(cuMemcpyAsync(dst, src, n, s)); break;
            case 1: CK(cuMemcpyDtoDAsync(dst, src, n, s)); break;
            case 2: if (cudaMemcpyAsync((void*)dst, (void*)src, n, cudaMemcpyDeviceToDevice, (cudaStream_t)s)) exit(2); break;
            case 3: copyk<<<(unsigned)((n / 16 + 255) / 256 < 264 ? (n / 16 + 255) / 256 : 264), 256, 0, (cudaStream_t)s>>>((const uint4*)src, (uint4*)dst, n / 16); break;
            case 4: { CUDA_MEMCPY2D p = {0}; p.srcMemoryType = CU_MEMORYTYPE_DEVICE; p.srcDevice = src; p.dstMemoryType = CU_MEMORYTYPE_DEVICE; p.dstDevice = dst; p.WidthInBytes = n; p.Height = 1; CK(cuMemcpy2DAsync(&p, s)); } break;
          }
        }
        issue += now() - t1;
        CK(cuStreamSynchronize(s));
      }
      double total = now() - t0;
      const char* names[] = {"cuMemcpyAsync", "cuMemcpyDtoDAsync", "cudaMemcpyAsync", "copy kernel", "cuMemcpy2DAsync"};
      printf("%7zu B %-18s issue %.2f us/call, pipelined %.2f us/copy (%.2f GB/s)\n", n, names[way], issue / N, total / N, n / (total / N) / 1e3);
    }
  }
  return 0;
}
