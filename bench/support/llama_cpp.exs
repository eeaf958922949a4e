defmodule Bench.LlamaCpp do
  @moduledoc false
  # How the benchmarks start a llama.cpp binary: with its own build's shared libraries first
  # on LD_LIBRARY_PATH. Its RUNPATH would find them, but an inherited LD_LIBRARY_PATH (say,
  # one naming another build's bin directory) is searched before RUNPATH, and then an AVX2-only
  # build silently runs the other build's kernels.

  @doc "The environment for `System.cmd/3` running a binary of the build in `bin`."
  def env(bin) do
    inherited = System.get_env("LD_LIBRARY_PATH")
    [{"LD_LIBRARY_PATH", Enum.join(Enum.reject([bin, inherited], &(&1 in [nil, ""])), ":")}]
  end

  @doc "The same for `Port.open/2` (charlists)."
  def port_env(bin) do
    for {k, v} <- env(bin), do: {String.to_charlist(k), String.to_charlist(v)}
  end
end
