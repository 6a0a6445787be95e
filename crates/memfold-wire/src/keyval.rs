//! QEMU's `key=value,key2=value2` option syntax, read as QEMU reads it: one parser for the
//! agent (which backends are guest RAM, the guest's name) and memfoldd (the monitor
//! socket a QEMU's command line names), which both read QEMU's command line.

use std::collections::BTreeMap;

/// Splits QEMU's `key=value,key2=value2` syntax: `,,` is a comma inside a value, a bare
/// `key` is `key=on`, except a bare first item, which is the value of key `implied` when
/// given (`-machine q35,...`: `type`; `-device pc-dimm,...`: `driver`; `-chardev
/// socket,...`: `backend`). A key given twice keeps its last value.
pub fn keyval(text: &str, implied: Option<&str>) -> BTreeMap<String, String> {
    let mut items = Vec::new();
    let mut cur = String::new();
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c == ',' {
            if chars.peek() == Some(&',') {
                chars.next();
                cur.push(',');
            } else {
                items.push(std::mem::take(&mut cur));
            }
        } else {
            cur.push(c);
        }
    }
    items.push(cur);
    let mut out = BTreeMap::new();
    for (i, item) in items.into_iter().enumerate() {
        if item.is_empty() {
            continue;
        }
        match item.split_once('=') {
            Some((k, v)) => {
                out.insert(k.to_string(), v.to_string());
            }
            None if i == 0 && implied.is_some() => {
                out.insert(implied.unwrap_or_default().to_string(), item);
            }
            None => {
                out.insert(item, "on".into());
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commas_doubled_are_one_comma_of_a_value() {
        let kv = keyval(
            "socket,id=m,path=/run/a,,b/q.sock,server=on",
            Some("backend"),
        );
        assert_eq!(kv["backend"], "socket");
        assert_eq!(kv["path"], "/run/a,b/q.sock");
        assert_eq!(kv["id"], "m");
        assert_eq!(kv["server"], "on");
        // A bare key is on; without an implied key, a bare first item too.
        assert_eq!(keyval("x,wait", None)["wait"], "on");
        assert_eq!(keyval("x,wait", None)["x"], "on");
        assert!(keyval("", None).is_empty());
    }
}
