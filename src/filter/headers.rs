//! A callback's headers, read in one host call where the proxy allows.

use crate::host;
use kvroute_core::codec::CodecError;
use kvroute_core::header_map::HeaderMap;
use proxy_wasm::types::LogLevel;

/// A callback's headers: read at once, or (should the proxy's map not
/// decode) one host call per header read with the given reader.
pub(super) enum Headers<'a> {
    Read(&'a HeaderMap<'a>),
    OneByOne(fn(&str) -> Option<String>),
}

impl<'a> Headers<'a> {
    /// The headers in `decoded` (what the proxy serialized, decoded), or
    /// `one_by_one` when there is no map; `which` names them in the log line.
    pub(super) fn of(
        decoded: &'a Option<Result<HeaderMap<'a>, CodecError>>,
        one_by_one: fn(&str) -> Option<String>,
        which: &str,
    ) -> Headers<'a> {
        match decoded {
            Some(Ok(map)) => Headers::Read(map),
            Some(Err(e)) => {
                host::log(
                    LogLevel::Warn,
                    &format!("kvroute: {which} headers unreadable at once ({e}); reading them one by one"),
                );
                Headers::OneByOne(one_by_one)
            }
            None => Headers::OneByOne(one_by_one),
        }
    }

    pub(super) fn get(&self, name: &str) -> Option<String> {
        match self {
            Headers::Read(map) => map.get(name),
            Headers::OneByOne(read) => read(name),
        }
    }

    pub(super) fn may_contain(&self, name: &str) -> bool {
        match self {
            Headers::Read(map) => map.contains(name),
            Headers::OneByOne(_) => true,
        }
    }
}
