//! The `fn_table!` macro: a struct of function pointers filled from a [`crate::loader::Opened`]
//! library, required symbols as plain fields and newer ones as `Option`.

/// Declare a `Lib` struct with one `unsafe extern "C" fn` field per symbol and a `load` that
/// looks every symbol up. Required symbols missing make `load` fail with
/// [`crate::LoadError::SymbolNotFound`]; optional ones are `None`.
macro_rules! fn_table {
    (
        $(#[$meta:meta])*
        library = $library:literal;
        required { $( $(#[$fm:meta])* $name:ident : fn($($arg:ty),* $(,)?) $(-> $ret:ty)? ; )* }
        optional { $( $(#[$om:meta])* $oname:ident : fn($($oarg:ty),* $(,)?) $(-> $oret:ty)? ; )* }
    ) => {
        $(#[$meta])*
        #[derive(Debug)]
        #[allow(missing_docs)]
        pub struct Lib {
            opened: $crate::loader::Opened,
            $( $(#[$fm])* pub $name: unsafe extern "C" fn($($arg),*) $(-> $ret)?, )*
            $( $(#[$om])* pub $oname: Option<unsafe extern "C" fn($($oarg),*) $(-> $oret)?>, )*
        }

        impl Lib {
            /// Look every symbol up in `opened`.
            ///
            /// # Safety
            ///
            /// `opened` must be the library this table describes (the signatures are its C ones).
            pub unsafe fn load(opened: $crate::loader::Opened) -> Result<Self, $crate::LoadError> {
                Ok(Lib {
                    $(
                        // SAFETY: the field's type is the symbol's C signature.
                        $name: unsafe { $crate::loader::symbol($library, &opened, stringify!($name)) }?,
                    )*
                    $(
                        // SAFETY: as above; a missing symbol is `None`.
                        $oname: unsafe { $crate::loader::symbol($library, &opened, stringify!($oname)) }.ok(),
                    )*
                    opened,
                })
            }

            /// Where the library was loaded from.
            pub fn path(&self) -> &str {
                &self.opened.path
            }
        }
    };
}

pub(crate) use fn_table;
