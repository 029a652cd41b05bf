// The host cost of a stream-ordered copy that tells the host when it is done, on GPU 0: a
// device-to-device copy followed by a 64-bit write of a sequence number into a word of mapped
// pinned host memory, queued on one stream, 32 at a time, then the stream synchronized. Ways:
// (a) cuMemcpyAsync alone (the raw loop), (b) cuMemcpyAsync + cuStreamWriteValue64 (what
// `write_on` queues now), (c) cuMemcpyAsync + cuEventRecord, (d) one graph of a memcpy node
// and a batch-mem-op node after it, both set anew per launch
// (cuGraphExecMemcpyNodeSetParams, cuGraphExecBatchMemOpNodeSetParams), (e) the same graph
// with only the copy node set and the word node left (its value fixed), to split the costs,
// (f) a one-node graph of the copy, set per launch, (g) (b) with the library's capture checks
// around each of its two calls (cuStreamIsCapturing before and after), (h) (d) with them
// around its launch. Sizes 4 KiB to 16 MiB; "issue" is the
// host time per copy before the synchronize, "pipelined" the whole time per copy. The word must
// hold the last sequence number after each synchronize (checked).
//
//   nvcc -O2 -o ordered_cost benches/baselines/ordered_cost.cu -lcuda && ./ordered_cost
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static double now() { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e6 + t.tv_nsec / 1e3; }
#define CK(x) do { CUresult r = (x); if (r) { printf("%s: %d\n", #x, r); exit(1); } } while (0)
enum { D = 32, N = 3200 };
static CUDA_MEMCPY3D piece(CUdeviceptr dst, CUdeviceptr src, size_t n) {
  CUDA_MEMCPY3D p; memset(&p, 0, sizeof p);
  p.srcMemoryType = CU_MEMORYTYPE_DEVICE; p.srcDevice = src; p.srcPitch = n; p.srcHeight = 1;
  p.dstMemoryType = CU_MEMORYTYPE_DEVICE; p.dstDevice = dst; p.dstPitch = n; p.dstHeight = 1;
  p.WidthInBytes = n; p.Height = 1; p.Depth = 1;
  return p;
}
static CUDA_BATCH_MEM_OP_NODE_PARAMS word_op(CUstreamBatchMemOpParams* op, CUdeviceptr word, unsigned long long v, CUcontext ctx) {
  memset(op, 0, sizeof *op);
  op->writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
  op->writeValue.address = word;
  op->writeValue.value64 = v;
  op->writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
  CUDA_BATCH_MEM_OP_NODE_PARAMS p; memset(&p, 0, sizeof p);
  p.ctx = ctx; p.count = 1; p.paramArray = op; p.flags = 0;
  return p;
}
int main() {
  CK(cuInit(0)); CUdevice dev; CK(cuDeviceGet(&dev, 0)); CUcontext ctx; CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  size_t sizes[] = {4096, 65536, 1 << 20, 16 << 20};
  CUdeviceptr a, b; CK(cuMemAlloc(&a, 1 << 30)); CK(cuMemAlloc(&b, 1 << 30));
  volatile unsigned long long* host; CK(cuMemHostAlloc((void**)&host, 64, CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE));
  CUdeviceptr word; CK(cuMemHostGetDevicePointer(&word, (void*)host, 0));
  CUstream s; CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CUevent ev; CK(cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
  const char* names[] = {"cuMemcpyAsync", "+ cuStreamWriteValue64", "+ cuEventRecord", "graph copy+word, both set", "graph copy+word, copy set", "1-node graph, set", "(b) + 4 capture checks", "(d) + 2 capture checks"};
  unsigned long long seq = 0;
  for (int k = 0; k < 4; k++) {
    size_t n = sizes[k];
    for (int way = 0; way < 8; way++) {
      CUgraph g = 0; CUgraphExec x = 0; CUgraphNode copy, op;
      CUstreamBatchMemOpParams opp;
      if (way >= 3 && way != 6) {
        CK(cuGraphCreate(&g, 0));
        CUDA_MEMCPY3D p = piece(b, a, n);
        CK(cuGraphAddMemcpyNode(&copy, g, NULL, 0, &p, ctx));
        if (way <= 4 || way == 7) {
          CUDA_BATCH_MEM_OP_NODE_PARAMS w = word_op(&opp, word, 0, ctx);
          CK(cuGraphAddBatchMemOpNode(&op, g, &copy, 1, &w));
        }
        CK(cuGraphInstantiate(&x, g, 0));
      }
      for (int i = 0; i < 50; i++) CK(cuMemcpyAsync(b, a, n, s));
      CK(cuStreamSynchronize(s));
      double issue = 0, t0 = now();
      for (int r = 0; r < N / D; r++) {
        double t1 = now();
        for (int i = 0; i < D; i++) {
          size_t off = (size_t)((r * D + i) % 32) * n % ((1 << 30) - n);
          CUdeviceptr src = a + off, dst = b + off;
          seq++;
          switch (way) {
            case 0: CK(cuMemcpyAsync(dst, src, n, s)); break;
            case 1: CK(cuMemcpyAsync(dst, src, n, s)); CK(cuStreamWriteValue64(s, word, seq, 0)); break;
            case 2: CK(cuMemcpyAsync(dst, src, n, s)); CK(cuEventRecord(ev, s)); break;
            case 6: {
              CUstreamCaptureStatus c;
              CK(cuStreamIsCapturing(s, &c)); CK(cuMemcpyAsync(dst, src, n, s)); CK(cuStreamIsCapturing(s, &c));
              CK(cuStreamIsCapturing(s, &c)); CK(cuStreamWriteValue64(s, word, seq, 0)); CK(cuStreamIsCapturing(s, &c));
            } break;
            case 3: case 4: case 5: case 7: {
              CUstreamCaptureStatus c;
              if (way == 7) CK(cuStreamIsCapturing(s, &c));
              CUDA_MEMCPY3D p = piece(dst, src, n);
              CK(cuGraphExecMemcpyNodeSetParams(x, copy, &p, ctx));
              if (way == 3 || way == 7) {
                CUDA_BATCH_MEM_OP_NODE_PARAMS w = word_op(&opp, word, seq, ctx);
                CK(cuGraphExecBatchMemOpNodeSetParams(x, op, &w));
              }
              CK(cuGraphLaunch(x, s));
              if (way == 7) CK(cuStreamIsCapturing(s, &c));
            } break;
          }
        }
        issue += now() - t1;
        CK(cuStreamSynchronize(s));
        if ((way == 1 || way == 3 || way == 6 || way == 7) && *host != seq) { printf("word %llu, want %llu\n", *host, seq); exit(1); }
      }
      double total = now() - t0;
      printf("%8zu B %-28s issue %.2f us/copy, pipelined %.2f us/copy (%.1f GB/s)\n", n, names[way], issue / N, total / N, n / (total / N) / 1e3);
      if (x) CK(cuGraphExecDestroy(x));
      if (g) CK(cuGraphDestroy(g));
    }
  }
  return 0;
}
