//! Host package for the workspace examples, integration tests and benches.
