defmodule Mix.Tasks.Compile.LlamaCppExNative do
  @moduledoc false
  # Builds the Rust NIF through the Makefile (cargo, release mode). Defined here so that the
  # project needs no build-tool dependency.
  use Mix.Task.Compiler

  @impl true
  def run(_args) do
    if System.get_env("LLAMA_CPP_EX_SKIP_NATIVE") in ["1", "true"] do
      {:noop, []}
    else
      make = System.find_executable("make") || Mix.raise("`make` is required to build LlamaCppEx")

      case System.cmd(make, ["--no-print-directory", "native"],
             cd: Path.dirname(__ENV__.file),
             into: IO.stream(:stdio, :line),
             stderr_to_stdout: true
           ) do
        {_, 0} ->
          {:ok, []}

        {_, status} ->
          Mix.raise("building the LlamaCppEx NIF failed (make exited with #{status})")
      end
    end
  end
end

defmodule LlamaCppEx.MixProject do
  use Mix.Project

  @version "0.1.0"
  @source_url "https://github.com/llama-cpp-ex/llama_cpp_ex"

  def project do
    [
      app: :llama_cpp_ex,
      version: @version,
      elixir: "~> 1.14",
      start_permanent: Mix.env() == :prod,
      compilers: [:llama_cpp_ex_native] ++ Mix.compilers(),
      elixirc_paths: elixirc_paths(Mix.env()),
      deps: [],
      description:
        "Local LLM inference for Elixir on a Rust/candle engine: GGUF models, " <>
          "continuous batching, paged KV cache with prefix sharing, token streams.",
      package: package(),
      docs: [main: "readme", extras: ["README.md", "CHANGELOG.md", "docs/architecture.md"]],
      source_url: @source_url
    ]
  end

  def application do
    [
      extra_applications: [:logger, :crypto, :inets, :ssl, :public_key],
      mod: {LlamaCppEx.Application, []}
    ]
  end

  defp elixirc_paths(:test), do: ["lib", "test/support"]
  defp elixirc_paths(_), do: ["lib"]

  defp package do
    [
      licenses: ["Apache-2.0"],
      links: %{"GitHub" => @source_url},
      files: [
        "lib",
        "priv/.gitkeep",
        "native/Cargo.toml",
        "native/Cargo.lock",
        "native/engine/Cargo.toml",
        "native/engine/src",
        "native/nif/Cargo.toml",
        "native/nif/src",
        "scripts",
        "Makefile",
        "mix.exs",
        "README.md",
        "CHANGELOG.md",
        "LICENSE"
      ]
    ]
  end
end
