"""The C++ compiler `make test` gives its processes (CXX: tests/cxx-no-debug-info, which runs CRAM_TEST_REAL_CXX
without `-g`) builds inductor's kernels as the compiler it runs would, so the suite's compiled runs execute the code
a user's compiled run would (docs/testing.md: Size and time). Outside `make test`, CXX is the user's own."""

import os

from launching import run
from torch._inductor import cpp_builder


def family(compiler: str) -> tuple[bool, bool]:
    """What inductor takes `compiler` for (GCC, clang): it chooses flags and the precompiled header's format by it."""
    return cpp_builder._is_gcc(compiler), cpp_builder._is_clang(compiler)


def test_inductor_takes_the_suites_compiler_for_the_one_it_runs():
    # A name inductor does not know (the script's own) builds every kernel without GCC's flags
    # (-fno-tree-loop-vectorize, -fexcess-precision=fast) and with a precompiled header GCC cannot read, so each
    # kernel parses torch's headers again: other code than a user's, and more than twice the compile time.
    compiler = cpp_builder.get_cpp_compiler()
    real = os.environ.get("CRAM_TEST_REAL_CXX", compiler)
    assert family(compiler) == family(real), (compiler, real)
    # And it is that compiler, reached: the same version line.
    versions = [run([program, "--version"], check=True).stdout.splitlines()[0] for program in (compiler, real)]
    assert versions[0] == versions[1]
