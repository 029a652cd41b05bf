// The host cost of queueing 32 device-to-device copies at once through a CUDA graph on GPU 0,
// against 32 cuMemcpyAsync calls: an executable graph of 32 independent memcpy nodes made once,
// then per burst (a) launched as it is, (b) each node's addresses and size set first
// (cuGraphExecMemcpyNodeSetParams) to another piece, then launched, (c) the same with the
// nodes chained (each after the one before); and (d) a burst captured from the stream
// (cuStreamBeginCapture, 32 cuMemcpyAsync, end, instantiate, launch, destroy). Each way queues
// 4,000 copies of 4 KiB, 64 KiB and 1 MiB, 32 at a time, synchronizing after each 32: "issue"
// is the host time per copy before the synchronize, "pipelined" the whole time per copy. It
// tells whether one submission for many copies can take the copy engines past the per-call
// floor that the engine's pipelined requests pay. Last, one copy at a time (queued, then the
// stream synchronized): cuMemcpyAsync against a one-node graph whose operands are set each time.
//
//   nvcc -O2 -o graph_cost benches/baselines/graph_cost.cu -lcuda && ./graph_cost
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static double now() { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e6 + t.tv_nsec / 1e3; }
#define CK(x) do { CUresult r = (x); if (r) { printf("%s: %d\n", #x, r); exit(1); } } while (0)
enum { D = 32, N = 4000 };
static CUDA_MEMCPY3D piece(CUdeviceptr dst, CUdeviceptr src, size_t n) {
  CUDA_MEMCPY3D p; memset(&p, 0, sizeof p);
  p.srcMemoryType = CU_MEMORYTYPE_DEVICE; p.srcDevice = src; p.srcPitch = n; p.srcHeight = 1;
  p.dstMemoryType = CU_MEMORYTYPE_DEVICE; p.dstDevice = dst; p.dstPitch = n; p.dstHeight = 1;
  p.WidthInBytes = n; p.Height = 1; p.Depth = 1;
  return p;
}
int main() {
  CK(cuInit(0)); CUdevice dev; CK(cuDeviceGet(&dev, 0)); CUcontext ctx; CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  size_t sizes[] = {4096, 65536, 1 << 20};
  CUdeviceptr a, b; CK(cuMemAlloc(&a, 64 << 20)); CK(cuMemAlloc(&b, 64 << 20));
  CUstream s; CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  const char* names[] = {"cuMemcpyAsync x32", "graph as made", "graph, params set", "chain, params set", "captured each time"};
  for (int k = 0; k < 3; k++) {
    size_t n = sizes[k];
    for (int way = 0; way < 5; way++) {
      CUgraph g = 0; CUgraphExec x = 0; CUgraphNode nodes[D];
      if (way >= 1 && way <= 3) {
        CK(cuGraphCreate(&g, 0));
        for (int i = 0; i < D; i++) {
          CUDA_MEMCPY3D p = piece(b + i * n, a + i * n, n);
          CUgraphNode* dep = (way == 3 && i > 0) ? &nodes[i - 1] : NULL;
          CK(cuGraphAddMemcpyNode(&nodes[i], g, dep, dep ? 1 : 0, &p, ctx));
        }
        CK(cuGraphInstantiate(&x, g, 0));
      }
      for (int i = 0; i < 50; i++) CK(cuMemcpyAsync(b, a, n, s));
      CK(cuStreamSynchronize(s));
      double issue = 0, t0 = now();
      for (int r = 0; r < N / D; r++) {
        double t1 = now();
        size_t shift = (r & 1) ? 0 : (size_t)D * n;  // alternate pieces: every set changes the node
        switch (way) {
          case 0:
            for (int i = 0; i < D; i++) CK(cuMemcpyAsync(b + shift + i * n, a + shift + i * n, n, s));
            break;
          case 1: CK(cuGraphLaunch(x, s)); break;
          case 2: case 3:
            for (int i = 0; i < D; i++) {
              CUDA_MEMCPY3D p = piece(b + shift + i * n, a + shift + i * n, n);
              CK(cuGraphExecMemcpyNodeSetParams(x, nodes[i], &p, ctx));
            }
            CK(cuGraphLaunch(x, s));
            break;
          case 4: {
            CUgraph cg; CUgraphExec cx;
            CK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_RELAXED));
            for (int i = 0; i < D; i++) CK(cuMemcpyAsync(b + shift + i * n, a + shift + i * n, n, s));
            CK(cuStreamEndCapture(s, &cg));
            CK(cuGraphInstantiate(&cx, cg, 0));
            CK(cuGraphLaunch(cx, s));
            CK(cuGraphExecDestroy(cx)); CK(cuGraphDestroy(cg));
          } break;
        }
        issue += now() - t1;
        CK(cuStreamSynchronize(s));
      }
      double total = now() - t0;
      printf("%7zu B %-20s issue %.2f us/copy, pipelined %.2f us/copy (%.2f GB/s)\n", n, names[way], issue / N, total / N, n / (total / N) / 1e3);
      if (x) CK(cuGraphExecDestroy(x));
      if (g) CK(cuGraphDestroy(g));
    }
  }
  // One copy at a time: queued, then the stream synchronized, as a single request is.
  {
    CUgraph g; CUgraphNode node; CUgraphExec x;
    CK(cuGraphCreate(&g, 0));
    CUDA_MEMCPY3D p0 = piece(b, a, 4096);
    CK(cuGraphAddMemcpyNode(&node, g, NULL, 0, &p0, ctx));
    CK(cuGraphInstantiate(&x, g, 0));
    for (int k = 0; k < 3; k++) {
      size_t n = sizes[k];
      for (int way = 0; way < 2; way++) {
        double issue = 0, t0 = now();
        for (int r = 0; r < N / 2; r++) {
          size_t shift = (r & 1) ? 0 : n;
          double t1 = now();
          if (way == 0) {
            CK(cuMemcpyAsync(b + shift, a + shift, n, s));
          } else {
            CUDA_MEMCPY3D p = piece(b + shift, a + shift, n);
            CK(cuGraphExecMemcpyNodeSetParams(x, node, &p, ctx));
            CK(cuGraphLaunch(x, s));
          }
          issue += now() - t1;
          CK(cuStreamSynchronize(s));
        }
        double total = now() - t0;
        printf("%7zu B one at a time, %-24s issue %.2f us, whole %.2f us a copy\n", n,
               way ? "a 1-node graph, set" : "cuMemcpyAsync", issue / (N / 2), total / (N / 2));
      }
    }
    CK(cuGraphExecDestroy(x)); CK(cuGraphDestroy(g));
  }
  return 0;
}
