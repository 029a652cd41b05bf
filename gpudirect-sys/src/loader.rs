//! Opening shared libraries at run time, with errors that say what was tried.

use std::path::PathBuf;

/// A library or one of its symbols could not be loaded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LoadError {
    /// None of the candidate file names could be opened.
    #[error("{library} not found (tried {}): {detail}", tried.join(", "))]
    LibraryNotFound {
        /// The library's short name, such as `libcufile`.
        library: &'static str,
        /// Every file name or path tried, in order.
        tried: Vec<String>,
        /// What the dynamic loader said for each candidate, joined with `; `.
        detail: String,
    },
    /// The library loaded but lacks a symbol (an older version).
    #[error("{library} ({path}) has no symbol {symbol}: the installed version is too old")]
    SymbolNotFound {
        /// The library's short name.
        library: &'static str,
        /// Where the library was loaded from.
        path: String,
        /// The missing symbol.
        symbol: &'static str,
    },
}

/// A library opened by [`open`], with the candidate that worked.
#[derive(Debug)]
pub struct Opened {
    /// The open library.
    pub lib: libloading::Library,
    /// The file name or path that opened.
    pub path: String,
}

/// `dlopen` each candidate in turn, after the path in `env_var` when that variable is set and
/// non-empty.
///
/// # Safety
///
/// Opening a library runs its initialisers; the candidates must name libraries whose initialisers
/// are sound to run in this process (the system's own CUDA, cuFile and rdma-core libraries are).
pub unsafe fn open(
    library: &'static str,
    candidates: &[&str],
    env_var: Option<&str>,
) -> Result<Opened, LoadError> {
    let mut tried = Vec::new();
    if let Some(p) = env_var.and_then(std::env::var_os).filter(|p| !p.is_empty()) {
        tried.push(PathBuf::from(p).display().to_string());
    }
    tried.extend(candidates.iter().map(|c| c.to_string()));
    let mut errors = Vec::new();
    for cand in &tried {
        // SAFETY: the caller vouches for the library's initialisers.
        match unsafe { libloading::Library::new(cand) } {
            Ok(lib) => {
                return Ok(Opened {
                    lib,
                    path: resolved_path(cand),
                });
            }
            // dlerror names the file itself; keep every candidate's reason (an explicit path
            // may fail for a different reason than "not found").
            Err(e) => errors.push(e.to_string()),
        }
    }
    let detail = if errors.is_empty() {
        String::from("no candidates")
    } else {
        errors.join("; ")
    };
    Err(LoadError::LibraryNotFound {
        library,
        tried,
        detail,
    })
}

/// Look up `symbol` in `opened` as a value of type `F` (a function pointer type).
///
/// # Safety
///
/// `F` must be the symbol's true C type.
pub unsafe fn symbol<F: Copy>(
    library: &'static str,
    opened: &Opened,
    symbol: &'static str,
) -> Result<F, LoadError> {
    let mut name = Vec::with_capacity(symbol.len() + 1);
    name.extend_from_slice(symbol.as_bytes());
    name.push(0);
    // SAFETY: the caller guarantees `F` is the symbol's type.
    match unsafe { opened.lib.get::<F>(&name) } {
        Ok(s) => Ok(*s),
        Err(_) => Err(LoadError::SymbolNotFound {
            library,
            path: opened.path.clone(),
            symbol,
        }),
    }
}

/// The file a soname resolved to, from `/proc/self/maps`; the name itself when not found.
fn resolved_path(name: &str) -> String {
    let base = std::path::Path::new(name)
        .file_name()
        .map(|b| b.to_string_lossy().into_owned())
        .unwrap_or_else(|| name.to_string());
    let stem = base.split(".so").next().unwrap_or(&base).to_string();
    if let Ok(maps) = std::fs::read_to_string("/proc/self/maps") {
        for line in maps.lines() {
            if let Some(path) = line.split_whitespace().nth(5) {
                let file = path.rsplit('/').next().unwrap_or(path);
                if file.starts_with(&format!("{stem}.so")) {
                    return path.to_string();
                }
            }
        }
    }
    name.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_library_names_every_candidate() {
        // SAFETY: these names do not exist, so nothing is initialised.
        let err = unsafe {
            open(
                "libnothere",
                &["libnothere.so.7", "libnothere.so"],
                Some("GPUDIRECT_TEST_NOTHERE_PATH"),
            )
        }
        .unwrap_err();
        match &err {
            LoadError::LibraryNotFound { library, tried, .. } => {
                assert_eq!(*library, "libnothere");
                assert_eq!(tried, &["libnothere.so.7", "libnothere.so"]);
            }
            other => panic!("unexpected {other:?}"),
        }
        let text = err.to_string();
        assert!(text.contains("libnothere.so.7, libnothere.so"), "{text}");
    }

    #[test]
    fn missing_symbol_is_typed() {
        // SAFETY: libc is already loaded in every process.
        let opened = unsafe { open("libc", &["libc.so.6"], None) }.unwrap();
        // SAFETY: the symbol does not exist; the type is never used.
        let err = unsafe { symbol::<extern "C" fn()>("libc", &opened, "gpudirect_no_such_symbol") }
            .unwrap_err();
        assert!(matches!(
            err,
            LoadError::SymbolNotFound {
                symbol: "gpudirect_no_such_symbol",
                ..
            }
        ));
        assert!(opened.path.contains("libc"), "{}", opened.path);
    }
}
