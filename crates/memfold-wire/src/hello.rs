//! What memfoldd reads of a connection's first message before it decodes it whole: its
//! kind and protocol version ([`HelloHead`]). A hello of another version (an agent older
//! or newer than memfoldd), or one that does not decode (an older hello lacks fields
//! added since), is then answered in the peer's own terms: an agent gets a
//! [`crate::ToAgent::Refused`] naming both versions ([`version_refusal`]). It got a
//! [`crate::ToClient::Error`], which an agent cannot decode, or no answer at all, and
//! tried again every second.

use serde::Deserialize;

use crate::PROTOCOL_VERSION;

/// The `type` of an agent's hello ([`crate::ToDaemon::AgentHello`]).
pub const AGENT_HELLO: &str = "agent_hello";

/// A first message's kind and version, read whatever else it holds.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct HelloHead {
    /// Its JSON's `type` (`agent_hello`, `client_hello`, `device_hello`...).
    #[serde(rename = "type")]
    pub kind: String,
    /// Its protocol version, if it says one as a number.
    #[serde(default)]
    pub version: Option<u32>,
}

impl HelloHead {
    /// The head of the message in `bytes`; `None` if they are not a JSON object with a
    /// string `type` (and, if it has one, a `version` that is a `u32`).
    pub fn of(bytes: &[u8]) -> Option<HelloHead> {
        serde_json::from_slice(bytes).ok()
    }

    /// Whether it is an agent's hello.
    pub fn is_agent(&self) -> bool {
        self.kind == AGENT_HELLO
    }
}

/// Why memfoldd refuses a hello of protocol version `theirs` (`None`: none said),
/// naming its own: sent to the agent and logged.
pub fn version_refusal(theirs: Option<u32>) -> String {
    let theirs = theirs.map_or("no version".into(), |v| format!("version {v}"));
    format!(
        "memfoldd speaks protocol version {PROTOCOL_VERSION}, the hello {theirs}: \
         run an agent of memfoldd's release"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The head is read from a hello of any version, old fields missing or new ones
    /// added, and from nothing else.
    #[test]
    fn a_hello_s_head_is_read_whatever_else_it_holds() {
        let old = br#"{"type":"agent_hello","version":7,"name":"web","pid":1,"ram_bytes":4096}"#;
        let h = HelloHead::of(old).unwrap();
        assert!(h.is_agent() && h.version == Some(7), "{h:?}");
        let newer = br#"{"type":"agent_hello","version":99,"later":[1,2]}"#;
        assert_eq!(HelloHead::of(newer).unwrap().version, Some(99));
        let client = HelloHead::of(br#"{"type":"client_hello","version":12}"#).unwrap();
        assert!(!client.is_agent());
        assert_eq!(HelloHead::of(br#"{"type":"stats"}"#).unwrap().version, None);
        for bad in [
            &b"{"[..],
            b"[1]",
            br#"{"version":12}"#,
            br#"{"type":"agent_hello","version":"12"}"#,
        ] {
            assert_eq!(HelloHead::of(bad), None, "{}", String::from_utf8_lossy(bad));
        }
        let why = version_refusal(Some(13));
        assert!(
            why.contains(&format!("protocol version {PROTOCOL_VERSION}")),
            "{why}"
        );
        assert!(why.contains("version 13"), "{why}");
    }
}
