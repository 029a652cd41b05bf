//! Small readers of sysfs and procfs files, shared by the report's checks.

use std::path::Path;

/// The file's text without surrounding whitespace; `None` when it cannot be read or is empty.
pub(crate) fn read_trimmed(p: &Path) -> Option<String> {
    let s = std::fs::read_to_string(p).ok()?.trim().to_string();
    (!s.is_empty()).then_some(s)
}

/// The names in directory `dir`, sorted; `None` when it cannot be read.
pub(crate) fn dir_names(dir: &Path) -> Option<Vec<String>> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    Some(v)
}
