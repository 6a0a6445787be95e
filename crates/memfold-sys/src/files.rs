//! Files memfold finds at a path it was given or keeps (a block device's base images and
//! stamps, memfoldd's candidates): what a file that is not a regular one is, in words.

use std::os::unix::fs::FileTypeExt;

/// What kind of file `t` is, for an error that refuses it: "a FIFO", "a symbolic link"
/// (as `symlink_metadata` sees one), "a folder", ... ("a regular file" for one).
pub fn kind_of(t: &std::fs::FileType) -> &'static str {
    if t.is_file() {
        "a regular file"
    } else if t.is_symlink() {
        "a symbolic link"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_dir() {
        "a folder"
    } else if t.is_block_device() {
        "a block device node"
    } else if t.is_char_device() {
        "a character device node"
    } else {
        "another kind of file"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_is_named() {
        let d = tempfile::tempdir().unwrap();
        let link = d.path().join("l");
        std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
        let kind =
            |p: &std::path::Path| kind_of(&std::fs::symlink_metadata(p).unwrap().file_type());
        assert_eq!(kind(&link), "a symbolic link");
        assert_eq!(kind(d.path()), "a folder");
        assert_eq!(
            kind(std::path::Path::new("/dev/null")),
            "a character device node"
        );
        let f = d.path().join("f");
        std::fs::write(&f, b"x").unwrap();
        assert_eq!(kind(&f), "a regular file");
    }
}
