/work/main/rust/target/debug/deps/hag_abi-22d2ebb6ebf1c8f2.d: hag_abi/src/lib.rs hag_abi/src/abi.rs

/work/main/rust/target/debug/deps/hag_abi-22d2ebb6ebf1c8f2: hag_abi/src/lib.rs hag_abi/src/abi.rs

hag_abi/src/lib.rs:
hag_abi/src/abi.rs:
