//! A tree over quick-xml events that writes back what it read, byte for byte: what
//! [`super::enable`] and [`super::disable`] edit, so that every part of a domain's XML
//! they do not touch is written as libvirt wrote it.

use quick_xml::events::{BytesEnd, BytesStart, BytesText, Event};
use quick_xml::{Reader, Writer};
use std::borrow::Cow;

use super::XmlError;

#[derive(Clone, Debug)]
pub(super) enum Node {
    Elem(Elem),
    /// Text, comments, CDATA, references, declarations: kept as read.
    Other(Event<'static>),
}

#[derive(Clone, Debug)]
pub(super) struct Elem {
    pub(super) start: BytesStart<'static>,
    pub(super) children: Vec<Node>,
    /// Read as `<x/>`: written so again while it has no children.
    pub(super) empty: bool,
}

impl Elem {
    pub(super) fn new(name: &str) -> Elem {
        Elem {
            start: BytesStart::new(name.to_string()),
            children: Vec::new(),
            empty: true,
        }
    }

    pub(super) fn with_attr(mut self, key: &str, value: &str) -> Elem {
        self.start.push_attribute((key, value));
        self
    }

    pub(super) fn name(&self) -> &[u8] {
        self.start.name().into_inner()
    }

    pub(super) fn is(&self, name: &str) -> bool {
        self.name() == name.as_bytes()
    }

    pub(super) fn attr(&self, key: &str) -> Option<String> {
        self.start
            .attributes()
            .with_checks(false)
            .flatten()
            .find(|a| a.key.as_ref() == key.as_bytes())
            .map(|a| {
                a.unescape_value()
                    .map(Cow::into_owned)
                    .unwrap_or_else(|_| String::from_utf8_lossy(&a.value).into_owned())
            })
    }

    pub(super) fn elems(&self) -> impl Iterator<Item = &Elem> {
        self.children.iter().filter_map(|n| match n {
            Node::Elem(e) => Some(e),
            Node::Other(_) => None,
        })
    }

    pub(super) fn child(&self, name: &str) -> Option<&Elem> {
        self.elems().find(|e| e.is(name))
    }

    pub(super) fn index_of(&self, name: &str) -> Option<usize> {
        self.children
            .iter()
            .position(|n| matches!(n, Node::Elem(e) if e.is(name)))
    }

    pub(super) fn child_mut(&mut self, name: &str) -> Option<&mut Elem> {
        let i = self.index_of(name)?;
        match &mut self.children[i] {
            Node::Elem(e) => Some(e),
            Node::Other(_) => None,
        }
    }

    /// The element's text (its text and references, unescaped; child elements skipped).
    pub(super) fn text(&self) -> String {
        let mut s = String::new();
        for n in &self.children {
            match n {
                Node::Other(Event::Text(t)) => s.push_str(&t.decode().unwrap_or_default()),
                Node::Other(Event::CData(t)) => s.push_str(&String::from_utf8_lossy(t)),
                Node::Other(Event::GeneralRef(r)) => {
                    if let Ok(Some(c)) = r.resolve_char_ref() {
                        s.push(c);
                    } else if let Ok(name) = r.decode() {
                        if let Some(v) = quick_xml::escape::resolve_predefined_entity(&name) {
                            s.push_str(v);
                        }
                    }
                }
                _ => {}
            }
        }
        s
    }

    /// The indentation before this element's children at `depth` (the root's children
    /// are at depth 1): the whitespace before its first child element if it has one,
    /// else two spaces a level, libvirt's style.
    pub(super) fn child_indent(&self, depth: usize) -> String {
        for (i, n) in self.children.iter().enumerate() {
            if let Node::Elem(_) = n {
                if let Some(Node::Other(Event::Text(t))) =
                    i.checked_sub(1).map(|j| &self.children[j])
                {
                    let t = String::from_utf8_lossy(t);
                    if t.trim().is_empty() && t.contains('\n') {
                        return t.into_owned();
                    }
                }
                break;
            }
        }
        format!("\n{}", "  ".repeat(depth))
    }

    /// Appends `e` as the last child element, indented like its siblings (`depth`: the
    /// depth of `e`).
    pub(super) fn append(&mut self, e: Elem, depth: usize) {
        // A parent written without whitespace between its children gets none either.
        let compact = !self.children.is_empty()
            && !self.children.iter().any(
                |n| matches!(n, Node::Other(Event::Text(t)) if t.iter().all(u8::is_ascii_whitespace)),
            );
        if compact {
            self.children.push(Node::Elem(e));
            self.empty = false;
            return;
        }
        let indent = self.child_indent(depth);
        let closing = format!("\n{}", "  ".repeat(depth.saturating_sub(1)));
        let ws = |s: &str| Node::Other(Event::Text(BytesText::from_escaped(s.to_string())));
        // The whitespace before the closing tag stays last.
        let at = match self.children.last() {
            Some(Node::Other(Event::Text(t))) if t.iter().all(u8::is_ascii_whitespace) => {
                self.children.len() - 1
            }
            _ => {
                self.children.push(ws(&closing));
                self.children.len() - 1
            }
        };
        self.children.insert(at, Node::Elem(e));
        self.children.insert(at, ws(&indent));
        self.empty = false;
    }

    /// Inserts `e` as a child right after the child element `after` (or last), indented
    /// like its siblings.
    pub(super) fn insert_after(&mut self, after: &[&str], e: Elem, depth: usize) {
        let pos = after.iter().filter_map(|a| self.index_of(a)).max();
        match pos {
            Some(i) => {
                let indent = self.child_indent(depth);
                let ws = Node::Other(Event::Text(BytesText::from_escaped(indent)));
                self.children.insert(i + 1, Node::Elem(e));
                self.children.insert(i + 1, ws);
                self.empty = false;
            }
            None => self.append(e, depth),
        }
    }

    /// Removes child `i` and the whitespace before it (the line it was on).
    pub(super) fn remove_at(&mut self, i: usize) -> Node {
        let node = self.children.remove(i);
        if i > 0 {
            if let Node::Other(Event::Text(t)) = &self.children[i - 1] {
                if t.iter().all(u8::is_ascii_whitespace) {
                    self.children.remove(i - 1);
                }
            }
        }
        if !self.children.iter().any(|n| matches!(n, Node::Elem(_)))
            && self.children.iter().all(|n| {
                matches!(n, Node::Other(Event::Text(t)) if t.iter().all(u8::is_ascii_whitespace))
            })
        {
            self.children.clear();
            self.empty = true;
        }
        node
    }
}

/// The document: what is before and after the root, and the root.
pub(super) struct Doc {
    pub(super) before: Vec<Node>,
    pub(super) root: Elem,
    pub(super) after: Vec<Node>,
}

pub(super) fn parse(xml: &str) -> Result<Doc, XmlError> {
    let mut reader = Reader::from_str(xml);
    reader.config_mut().trim_text(false);
    let mut stack: Vec<Elem> = Vec::new();
    let mut top: Vec<Node> = Vec::new();
    let err = |reader: &Reader<&[u8]>, message: String| XmlError::Parse {
        pos: reader.buffer_position(),
        message,
    };
    loop {
        let ev = reader
            .read_event()
            .map_err(|e| err(&reader, e.to_string()))?
            .into_owned();
        let node = match ev {
            Event::Start(s) => {
                stack.push(Elem {
                    start: s,
                    children: Vec::new(),
                    empty: false,
                });
                continue;
            }
            Event::End(_) => match stack.pop() {
                Some(e) => Node::Elem(e),
                None => return Err(err(&reader, "an end tag without a start".into())),
            },
            Event::Empty(s) => Node::Elem(Elem {
                start: s,
                children: Vec::new(),
                empty: true,
            }),
            Event::Eof => break,
            other => Node::Other(other),
        };
        match stack.last_mut() {
            Some(parent) => parent.children.push(node),
            None => top.push(node),
        }
    }
    if let Some(open) = stack.last() {
        return Err(err(
            &reader,
            format!("<{}> is not closed", String::from_utf8_lossy(open.name())),
        ));
    }
    let i = top
        .iter()
        .position(|n| matches!(n, Node::Elem(_)))
        .ok_or_else(|| XmlError::Parse {
            pos: 0,
            message: "no root element".into(),
        })?;
    let after = top.split_off(i + 1);
    let Some(Node::Elem(root)) = top.pop() else {
        unreachable!("position found an element at i")
    };
    if !root.is("domain") {
        return Err(XmlError::NotADomain(
            String::from_utf8_lossy(root.name()).into_owned(),
        ));
    }
    Ok(Doc {
        before: top,
        root,
        after,
    })
}

fn write_node(w: &mut Writer<Vec<u8>>, n: &Node) {
    // Writing into a Vec cannot fail.
    match n {
        Node::Other(ev) => w.write_event(ev.borrow()).expect("write to Vec"),
        Node::Elem(e) => {
            if e.empty && e.children.is_empty() {
                w.write_event(Event::Empty(e.start.borrow()))
                    .expect("write to Vec");
            } else {
                w.write_event(Event::Start(e.start.borrow()))
                    .expect("write to Vec");
                for c in &e.children {
                    write_node(w, c);
                }
                w.write_event(Event::End(BytesEnd::new(
                    String::from_utf8_lossy(e.name()).into_owned(),
                )))
                .expect("write to Vec");
            }
        }
    }
}

pub(super) fn write(doc: &Doc) -> String {
    let mut w = Writer::new(Vec::new());
    for n in &doc.before {
        write_node(&mut w, n);
    }
    write_node(&mut w, &Node::Elem(doc.root.clone()));
    for n in &doc.after {
        write_node(&mut w, n);
    }
    String::from_utf8(w.into_inner()).expect("the input was a str, the additions too")
}
