//! The address of a volume exported by an agent: `agent://[NAME@]host:port/VOLUME`.

use crate::error::CopyError;

/// A volume exported by an agent: `agent://host:port/NAME`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentUrl {
    /// Host name or address.
    pub host: String,
    /// gRPC port.
    pub port: u16,
    /// Export name.
    pub volume: String,
    /// The name the agent's certificate must carry (its node's), when it is not `host`:
    /// `agent://node-2@10.0.0.2:7070/pv-1`.
    pub tls_name: Option<String>,
}

impl AgentUrl {
    /// Parses `agent://[NAME@]host:port/VOLUME`; `None` if `s` is not an agent URL at all.
    pub fn parse(s: &str) -> Option<Result<AgentUrl, CopyError>> {
        let rest = s.strip_prefix("agent://")?;
        let bad = |why: &str| CopyError::BadDestination {
            path: s.into(),
            why: format!("{why}; expected agent://HOST:PORT/VOLUME"),
        };
        let parsed = (|| {
            let (authority, volume) = rest.split_once('/').ok_or_else(|| bad("no volume name"))?;
            let (tls_name, authority) = match authority.split_once('@') {
                Some((name, rest)) if !name.is_empty() => (Some(name.to_string()), rest),
                Some(_) => return Err(bad("an empty name before '@'")),
                None => (None, authority),
            };
            let (host, port) = authority.rsplit_once(':').ok_or_else(|| bad("no port"))?;
            let port = port.parse().map_err(|_| bad("the port is not a number"))?;
            if host.is_empty() || volume.is_empty() || volume.contains('/') {
                return Err(bad(
                    "empty host or volume name, or a '/' in the volume name",
                ));
            }
            Ok(AgentUrl {
                host: host.trim_matches(['[', ']']).into(),
                port,
                volume: volume.into(),
                tls_name,
            })
        })();
        Some(parsed)
    }
}

impl std::fmt::Display for AgentUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = self
            .tls_name
            .as_ref()
            .map(|n| format!("{n}@"))
            .unwrap_or_default();
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        write!(f, "agent://{name}{host}:{}/{}", self.port, self.volume)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_agent_urls() {
        assert_eq!(
            AgentUrl::parse("agent://node-b:7070/pvc-data")
                .unwrap()
                .unwrap(),
            AgentUrl {
                host: "node-b".into(),
                port: 7070,
                volume: "pvc-data".into(),
                tls_name: None,
            }
        );
        let named = AgentUrl::parse("agent://node-2@10.0.0.2:7070/pv-1")
            .unwrap()
            .unwrap();
        assert_eq!(
            (named.tls_name.as_deref(), named.host.as_str()),
            (Some("node-2"), "10.0.0.2")
        );
        assert_eq!(named.to_string(), "agent://node-2@10.0.0.2:7070/pv-1");
        assert_eq!(
            AgentUrl::parse("agent://[::1]:7070/v")
                .unwrap()
                .unwrap()
                .host,
            "::1"
        );
        assert!(AgentUrl::parse("/dev/sda").is_none());
        for bad in [
            "agent://host/v",
            "agent://host:x/v",
            "agent://host:1/",
            "agent://host:1",
            "agent://:1/v",
            "agent://@host:1/v",
        ] {
            assert!(AgentUrl::parse(bad).unwrap().is_err(), "{bad}");
        }
    }
}
