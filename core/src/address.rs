//! Pod addresses as the destination header carries them: one rule for every
//! place a pod enters (plugin config, indexer feed, remote lookup answers,
//! the indexer's own flags and ZMQ topics).

/// What [`is_pod_address`] asks of an address, for the messages that refuse one.
pub const POD_ADDRESS_RULE: &str = "host:port (port 1-65535; no comma, space or control character)";

/// `host:port` with a port from 1 to 65535. The host is a bracketed IPv6
/// address or a name of visible ASCII without `:`, `[`, `]` or a comma: the
/// destination header lists a decision's pods separated by commas, and a
/// header value cannot carry spaces or control characters.
pub fn is_pod_address(address: &str) -> bool {
    let Some((host, port)) = address.rsplit_once(':') else {
        return false;
    };
    let host_ok = match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(ipv6) => {
            !ipv6.is_empty()
                && ipv6
                    .bytes()
                    .all(|b| b.is_ascii_hexdigit() || b == b':' || b == b'.')
        }
        None => {
            !host.is_empty()
                && host
                    .bytes()
                    .all(|b| b.is_ascii_graphic() && !matches!(b, b':' | b'[' | b']' | b','))
        }
    };
    host_ok && port.bytes().all(|b| b.is_ascii_digit()) && port.parse::<u16>().is_ok_and(|p| p > 0)
}

#[cfg(test)]
mod tests {
    use super::is_pod_address;

    #[test]
    fn host_and_port() {
        for good in [
            "10.1.2.3:8000",
            "[::1]:8000",
            "[fd00::1.2.3.4]:8000",
            "vllm-0.vllm.llm.svc.cluster.local:8000",
            "a:1",
            "a:65535",
        ] {
            assert!(is_pod_address(good), "{good}");
        }
    }

    #[test]
    fn refused() {
        for bad in [
            "",
            "10.1.2.3",
            ":8000",
            "a:",
            "a:0",
            "a:65536",
            "a:+80",
            "a,b:80",
            "a b:80",
            "a\r\nx-injected: 1:80",
            "a\t:80",
            "pod-ä:80",
            "::1:80",
            "[]:80",
            "[::1:80",
            "[fe80::1%eth0]:80",
        ] {
            assert!(!is_pod_address(bad), "{bad:?}");
        }
    }
}
