defmodule Mix.Tasks.LlamaCppEx.Release do
  @shortdoc "Builds and packs the precompiled NIF artifacts and their checksum file"
  @moduledoc """
  Builds the NIF and the template-render helper for each target, packs each as
  `llama_cpp_ex-v<version>-nif-<nif>-<target>.tar.gz` and writes
  `checksum-Elixir.LlamaCppEx.NIF.exs` (SHA-256 per artifact, merged with the entries
  already in that file) next to them.

      mix llama_cpp_ex.release [--out DIR] [--target TRIPLE]... [--package DIR]

    * `--out` — where artifacts and the checksum file go (default `_build/release`);
    * `--target` — `host` or a triple of `LlamaCppEx.Precompiled.targets/0`; repeatable;
      default: every one of them that this machine can build. The host target is built by
      `make native`; `aarch64-unknown-linux-gnu` is cross-built with cargo and Debian's
      `gcc-aarch64-linux-gnu` as the linker;
    * `--package` — also lay out the package as Hex would ship it (the `package: [files:]`
      of mix.exs plus the checksum file) in DIR, to test an install from it.

  Upload the artifacts to the release page (or a mirror named by `LLAMA_CPP_EX_BASE_URL`)
  and ship the checksum file in the package.
  """
  use Mix.Task

  alias LlamaCppEx.Precompiled

  @cross_linkers %{"aarch64-unknown-linux-gnu" => "aarch64-linux-gnu-gcc"}

  @impl true
  def run(args) do
    {opts, _} = OptionParser.parse!(args, strict: [out: :string, target: :keep, package: :string])

    root = Path.dirname(Mix.Project.project_file())
    version = Mix.Project.config()[:version]
    out = Path.expand(Keyword.get(opts, :out, "_build/release"), root)
    {:ok, host} = Precompiled.target()

    targets =
      case Keyword.get_values(opts, :target) do
        [] -> Enum.filter(Precompiled.targets(), &buildable?(&1, host))
        ts -> Enum.map(ts, fn t -> if t == "host", do: host, else: t end)
      end

    sums =
      for target <- targets, nif <- Precompiled.nif_versions(), into: %{} do
        dir = build(root, target, host)
        name = Precompiled.artifact_name(version, nif, target, nil)
        sha = Precompiled.pack(dir, Path.join(out, name))
        Mix.shell().info("#{name} #{sha}")
        {name, sha}
      end

    file = Precompiled.write_checksums(out, sums)
    Mix.shell().info("wrote #{file}")

    if pkg = opts[:package], do: package(root, Path.expand(pkg), file)
  end

  defp buildable?(host, host), do: true

  defp buildable?(target, _host) do
    ok = Map.has_key?(@cross_linkers, target) and System.find_executable(@cross_linkers[target])

    if !ok do
      Mix.shell().info(
        "skipping #{target}: no cross linker #{@cross_linkers[target] || "known"} on the PATH"
      )
    end

    ok
  end

  defp build(root, host, host) do
    {_, 0} = System.cmd("make", ["--no-print-directory", "native"], cd: root, into: IO.stream())
    Path.join(root, "priv/native")
  end

  defp build(root, target, _host) do
    linker = Map.fetch!(@cross_linkers, target)
    target_dir = System.get_env("CARGO_TARGET_DIR") || Path.join(root, "native/target")
    env_target = target |> String.upcase() |> String.replace("-", "_")

    env = [
      {"CARGO_TARGET_#{env_target}_LINKER", linker},
      {"CC_#{String.replace(target, "-", "_")}", linker}
    ]

    for args <- [
          ["-p", "llama_cpp_ex_nif"],
          ["-p", "llama_cpp_ex_engine", "--bin", "llama_cpp_ex_render"]
        ] do
      cmd =
        ["build", "--release", "--target", target, "--manifest-path", "native/Cargo.toml"] ++
          args

      {_, 0} = System.cmd("cargo", cmd, cd: root, env: env, into: IO.stream())
    end

    built = Path.join([target_dir, target, "release"])
    dir = Path.join([root, "_build", "release-stage", target])
    File.mkdir_p!(dir)
    File.cp!(Path.join(built, "libllama_cpp_ex_nif.so"), Path.join(dir, "llama_cpp_ex_nif.so"))
    File.cp!(Path.join(built, "llama_cpp_ex_render"), Path.join(dir, "llama_cpp_ex_render"))
    dir
  end

  defp package(root, dest, checksum_file) do
    File.rm_rf!(dest)

    for pattern <- Mix.Project.config()[:package][:files],
        path <- Path.wildcard(Path.join(root, pattern)) do
      rel = Path.relative_to(path, root)
      File.mkdir_p!(Path.dirname(Path.join(dest, rel)))
      File.cp_r!(path, Path.join(dest, rel))
    end

    File.cp!(checksum_file, Path.join(dest, Precompiled.checksum_file()))
    Mix.shell().info("laid out the package in #{dest}")
  end
end
