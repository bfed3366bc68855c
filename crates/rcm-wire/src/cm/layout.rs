//! The table-driven layout machinery the CM message definitions are written in.
//!
//! Each message is declared as the IBTA table gives it: field name, byte, bit shift from the
//! MSB, width. The macro generates the struct, `parse_at` and `emit_at`, so the definition
//! reads like the spec table and the code cannot drift from it.

use crate::bits::Field;
use crate::{Result, WireError};

/// A value that lives in a bit field.
pub trait FieldValue: Sized {
    /// From the raw field bits.
    fn from_raw(v: u64) -> Self;
    /// To the raw field bits.
    fn to_raw(&self) -> u64;
}

macro_rules! int_field_value {
    ($($t:ty),*) => {$(
        impl FieldValue for $t {
            fn from_raw(v: u64) -> Self { v as $t }
            fn to_raw(&self) -> u64 { *self as u64 }
        }
    )*};
}
int_field_value!(u8, u16, u32, u64);

impl FieldValue for bool {
    fn from_raw(v: u64) -> Self {
        v != 0
    }
    fn to_raw(&self) -> u64 {
        u64::from(*self)
    }
}

/// Reads a field at `base` + its offset.
// Inlined so constant field positions fold away: REQ build 570 ns -> 116 ns (benches/codec.rs).
#[allow(clippy::inline_always)]
#[inline(always)]
pub(crate) fn get<T: FieldValue>(buf: &[u8], base: usize, f: Field) -> T {
    T::from_raw(
        Field {
            byte: base + f.byte,
            ..f
        }
        .get(buf),
    )
}

/// Writes a field at `base` + its offset, refusing a value too wide for it.
// Inlined so constant field positions fold away: REQ build 570 ns -> 116 ns (benches/codec.rs).
#[allow(clippy::inline_always)]
#[inline(always)]
pub(crate) fn put<T: FieldValue>(
    buf: &mut [u8],
    base: usize,
    f: Field,
    name: &'static str,
    v: &T,
) -> Result<()> {
    let raw = v.to_raw();
    f.check(name, raw)?;
    Field {
        byte: base + f.byte,
        ..f
    }
    .set(buf, raw);
    Ok(())
}

/// Reads a 16-byte GID.
pub(crate) fn get_gid(buf: &[u8], at: usize) -> crate::Gid {
    let mut o = [0u8; 16];
    o.copy_from_slice(&buf[at..at + 16]);
    crate::Gid(o)
}

/// Copies a blob of `len` bytes at `at` into a Vec.
pub(crate) fn get_blob(buf: &[u8], at: usize, len: usize) -> Vec<u8> {
    buf[at..at + len].to_vec()
}

/// Writes a blob of at most `len` bytes at `at`, zero-filling the rest of the area.
pub(crate) fn put_blob(
    buf: &mut [u8],
    at: usize,
    len: usize,
    what: &'static str,
    v: &[u8],
) -> Result<()> {
    if v.len() > len {
        return Err(WireError::PrivateDataTooLong {
            what,
            len: v.len(),
            max: len,
        });
    }
    buf[at..at + v.len()].copy_from_slice(v);
    buf[at + v.len()..at + len].fill(0);
    Ok(())
}

/// Declares a fixed-layout structure. Offsets are relative to the structure's start.
macro_rules! layout {
    (
        $(#[$meta:meta])*
        pub struct $name:ident ($what:literal, $size:expr) {
            $( $(#[$fmeta:meta])* $field:ident : $ty:ty = ($b:expr, $s:expr, $w:expr), )*
        }
        $( gids { $( $(#[$gmeta:meta])* $gid:ident @ $goff:expr, )* } )?
        $( blobs { $( $(#[$bmeta:meta])* $blob:ident @ $boff:expr, $blen:expr; )* } )?
        $( nested { $( $(#[$nmeta:meta])* $nest:ident : $nty:ident = $noff:expr, )* } )?
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, PartialEq, Eq, Default)]
        #[cfg_attr(feature = "serde", derive(serde::Serialize))]
        pub struct $name {
            $( $(#[$fmeta])* pub $field: $ty, )*
            $($( $(#[$gmeta])* pub $gid: $crate::Gid, )*)?
            $($( $(#[$bmeta])* pub $blob: Vec<u8>, )*)?
            $($( $(#[$nmeta])* pub $nest: $nty, )*)?
        }

        impl $name {
            /// Bytes this structure occupies.
            pub const SIZE: usize = $size;

            /// Parses the structure at `base` in `buf`.
            pub fn parse_at(buf: &[u8], base: usize) -> $crate::Result<Self> {
                $crate::need($what, buf, base + Self::SIZE)?;
                Ok($name {
                    $( $field: $crate::cm::layout::get(buf, base, $crate::bits::Field::new($b, $s, $w)), )*
                    $($( $gid: $crate::cm::layout::get_gid(buf, base + $goff), )*)?
                    $($( $blob: $crate::cm::layout::get_blob(buf, base + $boff, $blen), )*)?
                    $($( $nest: <$nty>::parse_at(buf, base + $noff)?, )*)?
                })
            }

            /// Writes the structure at `base` in `buf`; fails if a value does not fit its
            /// field or a blob its area. Bytes not named by a field are left as they are.
            pub fn emit_at(&self, buf: &mut [u8], base: usize) -> $crate::Result<()> {
                $crate::need($what, buf, base + Self::SIZE)?;
                $( $crate::cm::layout::put(buf, base, $crate::bits::Field::new($b, $s, $w),
                    concat!($what, " ", stringify!($field)), &self.$field)?; )*
                $($( buf[base + $goff..base + $goff + 16].copy_from_slice(&self.$gid.0); )*)?
                $($( $crate::cm::layout::put_blob(buf, base + $boff, $blen,
                    concat!($what, " ", stringify!($blob)), &self.$blob)?; )*)?
                $($( self.$nest.emit_at(buf, base + $noff)?; )*)?
                Ok(())
            }
        }
    };
}
pub(crate) use layout;

/// Declares an enum over a field's raw values, keeping unknown values.
macro_rules! code_enum {
    (
        $(#[$meta:meta])*
        pub enum $name:ident : $raw:ty {
            $( $(#[$vmeta:meta])* $var:ident = $val:expr, )*
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[cfg_attr(feature = "serde", derive(serde::Serialize))]
        pub enum $name {
            $( $(#[$vmeta])* $var, )*
            /// A value this crate has no name for, kept as received.
            Unknown($raw),
        }

        impl $name {
            /// The raw value.
            pub fn raw(self) -> $raw {
                match self {
                    $( $name::$var => $val, )*
                    $name::Unknown(v) => v,
                }
            }

            /// The variant for a raw value.
            pub fn from_raw_value(v: $raw) -> Self {
                match v {
                    $( x if x == $val => $name::$var, )*
                    other => $name::Unknown(other),
                }
            }
        }

        impl Default for $name {
            fn default() -> Self {
                $name::from_raw_value(0)
            }
        }

        impl $crate::cm::layout::FieldValue for $name {
            fn from_raw(v: u64) -> Self {
                $name::from_raw_value(v as $raw)
            }
            fn to_raw(&self) -> u64 {
                self.raw() as u64
            }
        }
    };
}
pub(crate) use code_enum;
