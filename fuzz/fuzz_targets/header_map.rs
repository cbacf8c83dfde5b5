//! The proxy's serialized request headers (the filter reads them in one
//! host call): decoding never panics and never reads past the input, and
//! every header it returns is found by name.
#![no_main]

use kvroute_core::header_map::HeaderMap;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(map) = HeaderMap::decode(data) {
        let held: usize = map.pairs().iter().map(|(n, v)| n.len() + v.len() + 2).sum();
        assert!(held <= data.len());
        for (name, _) in map.pairs() {
            if let Ok(name) = std::str::from_utf8(name) {
                assert!(map.contains(name));
                assert!(map.get(name).is_some());
            }
        }
    }
});
