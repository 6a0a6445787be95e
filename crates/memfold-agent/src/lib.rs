//! The memfold agent, preloaded into QEMU: `LD_PRELOAD=libmemfold_agent.so`.
//!
//! Inert unless `MEMFOLD_SOCKET` is set; then it starts the agent thread of
//! [`memfold_live::agent`] from the library's constructor.

extern "C" fn memfold_agent_init() {
    memfold_live::agent::start_from_env();
}

/// Runs at load time, like a C `__attribute__((constructor))`.
#[used]
#[unsafe(link_section = ".init_array")]
static INIT: extern "C" fn() = memfold_agent_init;
