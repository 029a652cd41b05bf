//! CUDA IPC (placeholder).
