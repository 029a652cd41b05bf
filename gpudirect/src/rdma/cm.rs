//! rdma_cm connections (placeholder)
