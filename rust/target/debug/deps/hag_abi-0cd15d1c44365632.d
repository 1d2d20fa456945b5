/work/main/rust/target/debug/deps/hag_abi-0cd15d1c44365632.d: hag_abi/src/lib.rs hag_abi/src/abi.rs

/work/main/rust/target/debug/deps/libhag_abi-0cd15d1c44365632.rlib: hag_abi/src/lib.rs hag_abi/src/abi.rs

/work/main/rust/target/debug/deps/libhag_abi-0cd15d1c44365632.rmeta: hag_abi/src/lib.rs hag_abi/src/abi.rs

hag_abi/src/lib.rs:
hag_abi/src/abi.rs:
