//! A disk that fills up under SQLite's commit: the commit fails, nothing is reported processed,
//! and the inbox keeps working on the same (single) connection once there is room again.
//!
//! The disk fills for real, as far as SQLite can tell: the process's file-size limit
//! (`RLIMIT_FSIZE`, with `SIGXFSZ` ignored) makes the write of the commit fail with `EFBIG`, which
//! SQLite reports as `SQLITE_FULL`. The limit holds for the whole process, so this file has one test
//! of its own.
#![cfg(all(feature = "sqlite", target_os = "linux"))]

#[path = "../support/mod.rs"]
mod support;

use std::time::Duration;

use idempotent::{Error, Inbox, InboxError, idempotent};
use sqlx::sqlite::SqlitePoolOptions;

#[derive(Debug, thiserror::Error)]
enum ShopError {
    #[error("database error in the handler")]
    Db(#[from] sqlx::Error),
}

struct Upload {
    id: String,
    bytes: usize,
}

#[idempotent(key = "id", consumer = "uploads")]
async fn store_upload(tx: &mut sqlx::SqliteConnection, msg: &Upload) -> Result<(), ShopError> {
    sqlx::query("INSERT INTO uploads (id, body) VALUES ($1, zeroblob($2))")
        .bind(&msg.id)
        .bind(msg.bytes as i64)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// Sets the process's file-size limit (`None`: no limit).
fn limit_file_size(bytes: Option<u64>) {
    let limit = bytes.unwrap_or(libc::RLIM_INFINITY);
    let rlimit = libc::rlimit {
        rlim_cur: limit,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: plain system calls with valid arguments.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
        assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &rlimit), 0);
    }
}

#[tokio::test]
async fn a_commit_that_fills_the_disk_fails_and_the_inbox_keeps_working() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let options = idempotent::sqlite::connect_options(&format!("sqlite://{}", path.display()))
        .unwrap()
        .pragma("wal_autocheckpoint", "0"); // the WAL only grows: its size is known
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(options)
        .await
        .unwrap();
    sqlx::query("CREATE TABLE uploads (id TEXT PRIMARY KEY, body BLOB)")
        .execute(&pool)
        .await
        .unwrap();
    let inbox = Inbox::new(pool.clone());
    inbox.migrate().await.unwrap();
    let small = |id: &str| Upload {
        id: id.into(),
        bytes: 10,
    };
    assert!(
        store_upload(&inbox, &small("before"))
            .await
            .unwrap()
            .is_processed()
    );

    // Room for a little more, not for a megabyte: the upload's pages go to the WAL at the commit.
    let used = ["inbox.db", "inbox.db-wal"]
        .iter()
        .map(|file| std::fs::metadata(dir.path().join(file)).map_or(0, |m| m.len()))
        .max()
        .unwrap();
    limit_file_size(Some(used + 64 * 1024));
    let big = Upload {
        id: "big".into(),
        bytes: 1 << 20,
    };
    let outcome = store_upload(&inbox, &big).await;
    limit_file_size(None);
    let error = outcome.expect_err("a commit on a full disk was reported processed");
    match &error {
        Error::Inbox(InboxError::Database { .. }) | Error::Transient(_) => {}
        other => panic!("expected the full disk as an error, got {other:?}"),
    }
    assert!(error.is_retryable(), "a full disk is retryable: {error:?}");

    // The only connection still works, and nothing of the failed upload was committed.
    assert!(
        store_upload(&inbox, &small("after"))
            .await
            .unwrap()
            .is_processed()
    );
    assert!(!inbox.is_processed("uploads", "big").await.unwrap());
    assert!(store_upload(&inbox, &big).await.unwrap().is_processed());
    assert!(store_upload(&inbox, &big).await.unwrap().is_duplicate());
    let uploads: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM uploads")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(uploads, 3);
}
