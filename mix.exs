# Loaded here, not compiled into the application: they run before its modules exist.
Code.require_file("mix/llama_cpp_ex/precompiled.ex", __DIR__)
Code.require_file("mix/tasks/llama_cpp_ex.release.ex", __DIR__)

defmodule Mix.Tasks.Compile.LlamaCppExNative do
  @moduledoc false
  # Installs the NIF: a precompiled artifact verified against the package's checksum file
  # (LlamaCppEx.Precompiled), or a cargo build through the Makefile (this repository's
  # checkout, LLAMA_CPP_EX_BUILD=1, or a target no artifact is published for). Defined here
  # so that the project needs no build-tool dependency.
  use Mix.Task.Compiler

  alias LlamaCppEx.Precompiled

  @impl true
  def run(_args) do
    if System.get_env("LLAMA_CPP_EX_SKIP_NATIVE") in ["1", "true"] do
      {:noop, []}
    else
      root = Path.dirname(__ENV__.file)

      case Precompiled.decide(root: root, version: Mix.Project.config()[:version]) do
        {:precompiled, name, sha} -> install(root, name, sha)
        {:source, reason} -> build(root, reason)
        {:error, message} -> Mix.raise("LlamaCppEx: " <> message)
      end
    end
  end

  defp install(root, name, sha) do
    env = System.get_env()

    opts = [
      dest: Path.join(root, "priv/native"),
      base_url:
        env["LLAMA_CPP_EX_BASE_URL"] ||
          Precompiled.default_base_url(Mix.Project.config()[:version]),
      cache_dir:
        Path.join(
          env["LLAMA_CPP_EX_CACHE_DIR"] || :filename.basedir(:user_cache, ~c"llama_cpp_ex"),
          "precompiled"
        ),
      env: env
    ]

    case Precompiled.install(name, sha, opts) do
      {:ok, :already_installed} ->
        {:noop, []}

      :ok ->
        Mix.shell().info("LlamaCppEx: installed the precompiled #{name} (#{sha})")
        {:ok, []}

      {:error, message} ->
        Mix.raise("LlamaCppEx: " <> message)
    end
  end

  defp build(root, reason) do
    with {:error, message} <- Precompiled.check_cargo(reason, System.find_executable("cargo")) do
      Mix.raise(message)
    end

    make = System.find_executable("make") || Mix.raise("`make` is required to build LlamaCppEx")

    if reason != :checkout,
      do: Mix.shell().info("LlamaCppEx: building the NIF from source (#{reason})")

    case System.cmd(make, ["--no-print-directory", "native"],
           cd: root,
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
        "mix",
        "priv/.gitkeep",
        "checksum-Elixir.LlamaCppEx.NIF.exs",
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
